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
