"""End to end: short 2-policy runs per strategy on the tiny models, and a single policy that learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mutualrl.config.resolve import load_config
from mutualrl.run.trainer import MutualTrainer, latest_checkpoint

STRATEGY_KEYS = {
    "independent": [],
    "xgrpo": ["xgrpo_pooled_prompts", "xgrpo_peer_rewards"],
    "prp": ["prp_peer_samples", "prp_refused"],
    "sgt": ["sgt_gate_open", "sgt_rescue", "sgt_refused"],
}
SHARING_PREFIXES = ("xgrpo_", "prp_", "sgt_")


def reward_digit_start(prompts, completions, **columns):
    """A trivially learnable extra reward: 1 when the completion starts with a digit."""
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def reward_digit_share(prompts, completions, **columns):
    """A denser learnable reward: the share of a completion's characters that are digits. Untrained
    tiny GPT-2 (271 byte-level tokens, 10 of them digits) starts a completion with a digit ~4% of the
    time, so the start-only reward leaves most groups without variance; every digit counts here."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def reward_brevity(prompts, completions, **columns):
    """A dense reward: shorter decoded completions score higher. Sampled completions differ in length
    almost surely, so every group has reward variance and every strategy's run must move the weights."""
    return [-len(c) / 100 for c in completions]


REWARD_FN = f"{__name__}:reward_digit_share"
BREVITY_FN = f"{__name__}:reward_brevity"


@pytest.fixture(scope="module")
def digits_file(tmp_path_factory) -> Path:
    """Single-digit sums, so that untrained models sometimes succeed (the verifier takes the last digit)."""
    path = tmp_path_factory.mktemp("data") / "digits.jsonl"
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in range(10) if a + b < 10]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tiny_models, digits_file, strategy: str) -> dict:
    return {
        "policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                     {"name": "b", "model": str(tiny_models["tiny-llama"])}],
        "task": {"datasets": [{"path": str(digits_file), "alias": "digits"}], "test_size": 8, "train_size": 40,
                 "answer_extraction": r"regex:(\d)", "reward_functions": [REWARD_FN, BREVITY_FN]},
        "grpo": {"num_generations": 4, "max_completion_length": 4, "learning_rate": 1e-2, "dynamic_sampling": "off"},
        "sharing": {"strategy": strategy},
        "steps": 2, "prompts_per_step": 4, "eval_every": 2, "eval_size": 8, "checkpoint_every": 1,
        "threads": 1, "seed": 0,
    }


def _read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["independent", "prp", "xgrpo", "sgt", "xgrpo+sgt"])
def test_two_policy_run_per_strategy(tiny_models, digits_file, tmp_path, strategy):
    cfg = _config(tiny_models, digits_file, strategy)
    run_dir = tmp_path / "run"
    summary = MutualTrainer(cfg, run_dir, progress=False).train()

    # summary and resolved config
    assert set(summary["policies"]) == {"a", "b"}
    assert load_config(str(run_dir / "config.yaml")) == load_config(cfg)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2

    # metrics: one train row per policy per step, evals at steps 0 and 2
    rows = _read_metrics(run_dir)
    train = [r for r in rows if r.get("event") is None]
    evals = [r for r in rows if r.get("event") == "eval"]
    assert sorted((r["step"], r["policy"]) for r in train) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert sorted((r["step"], r["policy"]) for r in evals) == [(0, "a"), (0, "b"), (2, "a"), (2, "b")]
    for name, p in summary["policies"].items():  # the summary is the first and last evaluation
        ev = sorted((r for r in evals if r["policy"] == name), key=lambda r: r["step"])
        assert (p["test_acc_initial"], p["test_acc_final"]) == (ev[0]["test_acc"], ev[-1]["test_acc"])
    wanted = [k for part in strategy.split("+") for k in STRATEGY_KEYS[part]]
    for r in train:
        for k in ("reward_mean", "train_acc", "loss", "gen_tokens", "train_tokens", "zero_var_group_frac",
                  "step_s", "reward_fn_raised"):
            assert k in r, (strategy, k)
        for k in wanted:
            assert k in r, (strategy, k)
        allowed = tuple(f"{part}_" for part in strategy.split("+"))
        others = [k for k in r if k.startswith(SHARING_PREFIXES) and not k.startswith(allowed)]
        assert not others, (strategy, others)
        if strategy != "prp":  # own rows only: behavior and recomputed log-probs agree at step start
            assert r["logprob_mismatch_max"] < 1e-3
        if "xgrpo" in strategy:
            # the peer published a group outcome for every shared prompt
            assert r["xgrpo_pooled_prompts"] == 4 and r["xgrpo_peer_rewards"] == 16
        if "sgt" in strategy:
            assert r["sgt_refused"] == 0  # same task, same verifier: every peer success re-verifies
            assert ("rescue_nll" in r) == (r["sgt_rescue"] > 0)  # rescue rows, when there are any, trained
        if strategy == "prp":
            # every offered peer rollout is used or refused; the Unigram learner cannot write the bytes an
            # untrained byte-level BPE peer emits (<unk>), and refuses those rows rather than train on them
            assert r["prp_peer_samples"] + r["prp_refused"] == 16
            assert r["prp_refused"] == r.get("prp_refused/unrepresentable", 0)
            if r["policy"] == "a":  # the byte-level learner represents any text
                assert r["prp_peer_samples"] == 16
                assert r["prp_ratio_max"] >= r["prp_ratio_mean"]
                # clip c = 1: a ratio above it is truncated, so the truncated share is 0 exactly when max <= 1
                assert (r["prp_ratio_truncated_frac"] > 0) == (r["prp_ratio_max"] > 1.0)
    for r in evals:  # one source: the per-source accuracy is the accuracy (8 problems: a multiple of 1/8)
        assert r["test_acc/digits"] == r["test_acc"] and (8 * r["test_acc"]).is_integer()

    # checkpoints: one per step, LATEST points to the last, every policy's weights differ from the start
    ck = latest_checkpoint(run_dir)
    assert ck is not None and ck.name == "step_000002"
    assert (run_dir / "checkpoints" / "step_000001" / "trainer_state.json").is_file()
    assert json.loads((ck / "trainer_state.json").read_text())["next_step"] == 2
    for name, model in (("a", "tiny-gpt2"), ("b", "tiny-llama")):
        for f in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
            assert (ck / name / f).is_file(), (name, f)
        after = load_file(str(ck / name / "model.safetensors"))
        before = load_file(str(tiny_models[model] / "model.safetensors"))
        common = [k for k in after if k in before]
        assert common
        assert any(not torch.equal(after[k], before[k]) for k in common), name


def test_in_memory_run_shares_and_sgt_rescues(tiny_models, digits_file):
    """Without a run directory the policies still share (one in-memory exchange for the run), and
    over a few steps SGT rescues failed groups with peer successes."""
    cfg = _config(tiny_models, digits_file, "xgrpo+sgt")
    cfg.update(steps=4, prompts_per_step=8, eval_every=100, checkpoint_every=100)
    cfg["grpo"]["max_completion_length"] = 6
    trainer = MutualTrainer(cfg, None, progress=False)
    trainer.train()
    train = [r for r in trainer.history if r.get("event") is None]
    assert len(train) == 8
    assert all(r["xgrpo_pooled_prompts"] == 8 and r["xgrpo_peer_rewards"] == 32 for r in train)
    assert sum(r["sgt_gate_open"] for r in train) > 0
    assert sum(r["sgt_rescue"] for r in train) > 0
    assert any("rescue_nll" in r for r in train)


def test_single_policy_reward_goes_up(tiny_models):
    """Plain GRPO on a trivially learnable reward: the mean reward rises within 15 steps."""
    cfg = {
        "policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])}],
        "task": {"preset": "zoo", "test_size": 4, "train_size": 100,
                 "reward_functions": [REWARD_FN]},
        "grpo": {"num_generations": 8, "max_completion_length": 3, "learning_rate": 3e-2, "loss_type": "grpo"},
        "steps": 15, "prompts_per_step": 4, "eval_every": 1000, "eval_size": 2, "checkpoint_every": 1000,
        "threads": 1, "seed": 0,
    }
    trainer = MutualTrainer(cfg, None, progress=False)
    trainer.train()
    rewards = [r["reward_mean"] for r in trainer.history if r.get("event") is None]
    assert len(rewards) == 15
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.4, rewards
    assert last > 0.6, rewards


def test_cli_train_writes_a_run_directory(tiny_models, digits_file, tmp_path, capsys):
    import yaml

    from mutualrl.cli import main

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tiny_models, digits_file, "independent")))
    out = tmp_path / "out"
    assert main(["train", str(cfg_path), "-o", str(out), "--steps", "1", "--strategy", "sgt", "--no-progress"]) == 0
    assert "run directory" in capsys.readouterr().out
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.steps == 1 and cfg.sharing.strategy == "sgt"
    train = [r for r in _read_metrics(out) if r.get("event") is None]
    assert len(train) == 2 and all("sgt_rescue" in r for r in train)
    assert latest_checkpoint(out) is not None


def test_a_control_on_a_schedule_takes_no_optimizer_step_where_its_entry_is_zero(tiny_models, digits_file, tmp_path):
    """``sharing.self_imitate.match_schedule`` end to end: the run's step ``t`` reads entry ``t`` (a dense
    reward makes every step trainable), so a 0 entry leaves that step without rows or an optimizer
    step, and the others train."""
    cfg = _config(tiny_models, digits_file, "self_imitate")
    cfg["steps"], cfg["checkpoint_every"], cfg["eval_every"] = 3, 3, 3
    cfg["sharing"]["self_imitate"] = {"match_schedule": [1000, 0, 1000], "match_ceiling": True}
    run_dir = tmp_path / "run"
    MutualTrainer(cfg, run_dir, progress=False).train()
    train = [r for r in _read_metrics(run_dir) if r.get("event") is None]
    steps = {(r["step"], r["policy"]): (r["optimizer_steps"], r["train_tokens"]) for r in train}
    for p in ("a", "b"):
        assert steps[(1, p)] == (0, 0)
        assert steps[(0, p)][0] == 1 and steps[(0, p)][1] > 0 and steps[(2, p)][0] == 1
