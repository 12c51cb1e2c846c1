"""Shared fixtures: tiny heterogeneous models built once per test session (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mutualrl.zoo import build_tiny_models  # after the offline switch above


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two untrained tiny causal LMs of different families and tokenizer algorithms.

    ``{"tiny-gpt2": dir (GPT-2, byte-level BPE), "tiny-llama": dir (Llama, Unigram)}``.
    """
    return build_tiny_models(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture()
def tiny_config(tiny_models: dict[str, Path]) -> dict:
    """A 2-policy run config dict on the tiny models and the zoo task (a few steps)."""
    return {
        "policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                     {"name": "b", "model": str(tiny_models["tiny-llama"])}],
        "task": {"preset": "zoo", "test_size": 40},
        "grpo": {"num_generations": 4, "max_completion_length": 6},
        "steps": 3, "prompts_per_step": 4, "eval_every": 2, "eval_size": 40, "checkpoint_every": 2,
    }


@pytest.fixture(scope="session")
def trained_zoo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run of two shipped zoo policies that share (``imitate``): ``g`` (zoo:gpt2-add,
    every weight trained) and ``l`` (zoo:llama-sub, a LoRA adapter), checkpoints after steps 1 and 2,
    held-out evaluations at steps 0, 1 and 2, the final models under ``final/`` (``save_final_model``).
    A dense reward (shorter is better) with dynamic sampling off makes every step move the weights.
    Read-only for its users (tests/test_export.py, tests/test_eval_model.py)."""
    from mutualrl.run.trainer import MutualTrainer

    cfg = {"policies": [{"name": "g", "model": "zoo:gpt2-add"},
                        {"name": "l", "model": "zoo:llama-sub", "grpo": {"learning_rate": 3e-2},
                         "peft": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}],
           "task": {"preset": "zoo", "test_size": 20, "train_size": 200,
                    "reward_functions": ["test_trainer:reward_brevity"]},
           "grpo": {"num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-3,
                    "dynamic_sampling": "off"},
           "sharing": {"strategy": "imitate"},
           "steps": 2, "prompts_per_step": 4, "eval_every": 1, "eval_size": 20, "checkpoint_every": 1,
           "threads": 1, "save_final_model": True}
    run_dir = tmp_path_factory.mktemp("zoo_run") / "run"
    MutualTrainer(cfg, run_dir, progress=False).train()
    return run_dir
