"""Shared fixtures: tiny heterogeneous models built once per test session (no downloads)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _build_tiny(root: Path) -> dict[str, Path]:
    import torch

    from mutualrl.zoo import ZOO, build_model, default_task
    from mutualrl.zoo_tokenizers import train_tokenizer

    torch.manual_seed(0)
    task = default_task(seed=0, test_size=50, train_size=500)
    texts = [p.question + " Answer: " + p.answer for p in task.problems("train")]
    out = {}
    for name, zoo_name, kind, extra in [("tiny-gpt2", "gpt2-add", "byte_bpe", {}),
                                        ("tiny-llama", "llama-sub", "unigram", {"n_kv_head": 1})]:
        spec = dataclasses.replace(ZOO[zoo_name], n_layer=1, n_embd=32, n_head=2, n_inner=64, **extra)
        tok = train_tokenizer(kind, texts, spec.vocab_size)
        model = build_model(spec, tok)
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = d
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two untrained tiny causal LMs of different families and tokenizer algorithms.

    ``{"tiny-gpt2": dir (GPT-2, byte-level BPE), "tiny-llama": dir (Llama, Unigram)}``.
    """
    return _build_tiny(tmp_path_factory.mktemp("tiny_models"))


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
