"""TRL/peft memory options on CPU: gradient checkpointing (same gradients) and LoRA (only the adapter
trains and is checkpointed, the reference is the base with the adapter off, reward still rises)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from mutualrl.algorithms.sharing import TrainBatch, TrainRow
from mutualrl.algorithms.update import train_on_batch
from mutualrl.config import GRPOOptions, PeftConfig
from mutualrl.rollout.policy import Policy
from mutualrl.run.trainer import MutualTrainer

Q = ["Calculate 12 + 34.", "Calculate 98 - 7."]


def _grads(pol: Policy) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    samples = pol.generate(Q, 4)
    rows = [TrainRow(s.prompt_ids, s.completion_ids, a, s.logprobs)
            for s, a in zip(samples, [1.0, -1.0, 0.5, -0.5] * 2, strict=True)]
    pol.optimizer.step = lambda *a, **k: None  # keep the weights: compare the gradients of one pass
    train_on_batch(pol, TrainBatch(rows))
    return {n: p.grad.clone() for n, p in pol.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_models, name):
    plain = _grads(Policy("p", str(tiny_models[name]), GRPOOptions(max_completion_length=5), seed=0))
    ckpt = _grads(Policy("p", str(tiny_models[name]), GRPOOptions(max_completion_length=5,
                                                                   gradient_checkpointing=True), seed=0))
    assert plain.keys() == ckpt.keys() and plain
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], atol=1e-6, rtol=1e-5), k


def test_lora_trains_only_the_adapter_and_uses_the_base_as_reference(tiny_models):
    pol = Policy("l", str(tiny_models["tiny-llama"]), GRPOOptions(max_completion_length=5, beta=0.1,
                                                                  learning_rate=5e-2),
                 peft=PeftConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), seed=0)
    assert pol.ref_model is None  # no second copy of the model
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
    samples = pol.generate(Q, 4)
    rows = [TrainRow(s.prompt_ids, s.completion_ids, a, s.logprobs)
            for s, a in zip(samples, [1.0, -1.0, 0.5, -0.5] * 2, strict=True)]
    for _ in range(2):
        stats = train_on_batch(pol, TrainBatch(rows))
    changed = {n for n, p in pol.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert stats["kl"] > 0  # the adapter moved the policy away from the base it is compared with
    keys = pol.checkpoint_keys()
    assert keys and all("lora_" in k for k in keys) and len(keys) == 4 * len(pol.model.base_model.model.model.layers)


def test_lora_and_checkpointing_run_learns_and_resumes_exactly(tiny_models, tmp_path):
    from _stop import _Stop, _StopAfterStep2

    cfg = {
        "policies": [{"name": "a", "model": str(tiny_models["tiny-llama"]),
                      "peft": {"r": 8, "lora_alpha": 16, "target_modules": ["lm_head", "q_proj", "v_proj", "up_proj"]}}],
        "task": {"preset": "zoo", "test_size": 4, "train_size": 100,
                 "reward_functions": ["test_trainer:reward_digit_start"]},
        "grpo": {"num_generations": 8, "max_completion_length": 3, "learning_rate": 3e-2, "loss_type": "grpo",
                 "gradient_checkpointing": True},
        "steps": 12, "prompts_per_step": 4, "eval_every": 1000, "eval_size": 2, "checkpoint_every": 2,
        "threads": 1, "seed": 0,
    }
    full = MutualTrainer(cfg, tmp_path / "full", progress=False)
    full.train()
    rewards = [r["reward_mean"] for r in full.history if r.get("event") is None]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    ck = tmp_path / "full" / "checkpoints" / "step_000012" / "a"
    from safetensors.torch import load_file

    assert all("lora_" in k for k in load_file(str(ck / "model.safetensors")))  # the adapter only
    with pytest.raises(_Stop):
        _StopAfterStep2(dict(cfg, steps=4), tmp_path / "cut", progress=False).train()
    MutualTrainer(dict(cfg, steps=4), tmp_path / "cut", resume=True, progress=False).train()

    def rows(d):
        return [(r["step"], r["reward_mean"], r["loss"]) for r in map(json.loads, (d / "metrics.jsonl").read_text()
                                                                       .splitlines()) if r.get("event") is None]

    assert rows(tmp_path / "cut") == rows(tmp_path / "full")[:4]


def test_retain_freed_memory_takes_effect_on_glibc_and_is_idempotent() -> None:
    """On Linux with glibc the heap option is in effect after the call (and a second call agrees);
    elsewhere it reports that it is not."""
    import platform
    import sys

    from mutualrl import heap

    got = heap.retain_freed_memory()
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert got is glibc and heap.retained() is glibc
    assert heap.retain_freed_memory() is glibc


def test_retain_freed_memory_is_a_checked_run_option() -> None:
    from mutualrl.config.resolve import load_config
    from mutualrl.errors import ConfigError

    base = {"policies": [{"name": "a", "model": "zoo:gpt2-add"}], "task": {"preset": "zoo"}}
    assert load_config(base, check_paths=False).retain_freed_memory is True
    assert load_config({**base, "retain_freed_memory": False}, check_paths=False).retain_freed_memory is False
    with pytest.raises(ConfigError, match="retain_freed_memory"):
        load_config({**base, "retain_freed_memory": "yes"}, check_paths=False)


def test_flush_denormals_is_scoped_and_zoo_builds_keep_them() -> None:
    from mutualrl.denormals import denormals_flushed, denormals_kept, flushing

    assert not flushing()
    with denormals_flushed() as on:
        if not on:
            pytest.skip("this CPU cannot flush denormals")
        assert flushing() and (torch.tensor([1e-39]) * 1.0).item() == 0.0
        with denormals_kept():
            assert not flushing() and (torch.tensor([1e-39]) * 1.0).item() > 0.0
        assert flushing()
    assert not flushing()  # the thread's setting is back
    assert load_run_option("flush_denormals") is True


def test_a_run_leaves_the_callers_denormals_alone(tiny_config, tmp_path) -> None:
    """Workers flush denormals while they work; the calling process (sequential scheduler: the same
    thread) has exact denormals again when the run returns."""
    from mutualrl.denormals import flushing

    cfg = {**tiny_config, "steps": 1, "eval_every": 1}
    MutualTrainer(cfg, tmp_path / "run", progress=False).train()
    assert not flushing()


def load_run_option(name: str):
    from mutualrl.config.resolve import load_config

    base = {"policies": [{"name": "a", "model": "zoo:gpt2-add"}], "task": {"preset": "zoo"}}
    return getattr(load_config(base, check_paths=False), name)
