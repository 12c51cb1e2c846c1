"""The lean decoding step samples what the model's own forward samples (mutualrl.rollout.engines.decode_step)."""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import GRPOOptions
from mutualrl.rollout.engines import HFEngine, SamplingParams
from mutualrl.rollout.engines.decode_step import DECODE_STEPS, StaticKV, decode_step_for
from mutualrl.rollout.policy import Policy

PROMPTS = [[5, 9, 4, 7, 3, 8], [6, 4], [7, 7, 3, 12, 5]]  # ragged: left padding inside the batch


def _tiny(kind: str, **over) -> torch.nn.Module:
    """A randomly initialised model of ``kind`` (eos 2, pad 0), in eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    common = {"vocab_size": 40, "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=64, vocab_size=40, **over)
    else:
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
               "qwen3": tf.Qwen3Config}[kind]
        kw = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, head_dim=8, **common)
        kw.update(over)
        cfg = cls(**kw)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():  # random biases and norm weights, so that each is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _both(model: torch.nn.Module, **params) -> tuple[HFEngine, dict]:
    out = {}
    for lean in (False, True):
        eng = HFEngine(model, [2], 0, torch.Generator().manual_seed(3), lean_step=lean)
        out[lean] = [eng.generate(PROMPTS, 3, SamplingParams(max_new_tokens=9, **params)) for _ in range(2)]
    return eng, out


def _assert_same(out: dict) -> None:
    for a, b in zip(out[False], out[True], strict=True):
        assert a.ids == b.ids and a.finished == b.finished
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("greedy", [False, True])
def test_lean_step_samples_what_the_model_samples(kind, greedy) -> None:
    eng, out = _both(_tiny(kind), greedy=greedy, temperature=0.8)
    assert eng.lean is True, kind
    _assert_same(out)


def test_lean_step_covers_multi_query_and_tied_heads() -> None:
    model = _tiny("llama", num_key_value_heads=1, tie_word_embeddings=True)
    eng, out = _both(model)
    assert eng.lean is True
    _assert_same(out)


def test_lean_step_with_lora_adapters_is_the_adapted_model() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # LoRA's B starts at zero: move it so the adapters change the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.eval()
    eng, out = _both(model)
    assert eng.lean is True
    _assert_same(out)


def test_a_step_that_does_not_match_is_found_and_the_model_forward_kept(monkeypatch) -> None:
    model = _tiny("gpt2")
    attend = StaticKV.attend
    monkeypatch.setattr(StaticKV, "attend", lambda self, *a: attend(self, *a) * 1.05)
    eng, out = _both(model)
    assert eng.lean is False
    _assert_same(out)  # what it sampled is the model's own forward's, the first call included


def test_unknown_architectures_and_short_windows_keep_the_model_forward() -> None:
    import transformers as tf

    torch.manual_seed(0)
    neox = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                  num_hidden_layers=2, vocab_size=40)).eval()
    assert "gpt_neox" not in DECODE_STEPS and decode_step_for(neox) is None
    eng = HFEngine(neox, [2], 0, torch.Generator().manual_seed(3), lean_step=True)
    eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4))
    assert eng.lean is False
    mistral = _tiny("mistral", sliding_window=8)
    eng = HFEngine(mistral, [2], 0, torch.Generator().manual_seed(3), lean_step=True)
    eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6))  # 6 + 6 positions > the window of 8
    assert eng.lean is None and eng._step.window == 8  # never checked, never used
    eng.generate([[5, 6]], 2, SamplingParams(max_new_tokens=5))  # 7 positions: inside the window
    assert eng.lean is True
    assert decode_step_for(_tiny("gpt2", reorder_and_upcast_attn=True)) is None


def test_policies_decode_lean_by_default(tiny_models) -> None:
    from mutualrl.config import GenerationConfig

    pol = Policy("p", str(tiny_models["tiny-gpt2"]), GRPOOptions(num_generations=2, max_completion_length=4))
    assert pol.engine.lean is None  # checked on the first call
    pol.engine.generate([pol.encode_prompt("What is 1 + 2?")], 2, SamplingParams(max_new_tokens=4))
    assert pol.engine.lean is True
    off = Policy("q", str(tiny_models["tiny-llama"]), GRPOOptions(), generation=GenerationConfig(lean_decoding=False))
    assert off.engine.lean is False


def test_lean_step_stops_a_row_at_eos() -> None:
    eng = HFEngine(_tiny("llama"), [2], 0, torch.Generator().manual_seed(3), lean_step=True)
    eng.generate(PROMPTS, 1, SamplingParams(max_new_tokens=3))
    assert eng.lean is True
    head, calls = eng._head_logits, {"n": 0}

    def forced(hidden, buf):
        out = head(hidden, buf)
        calls["n"] += 1
        if calls["n"] == 2:  # the 3rd token of row 1 (the 1st comes from the prefill)
            out[1, 2] += 1e4
        return out

    eng._head_logits = forced
    g = eng.generate(PROMPTS, 1, SamplingParams(max_new_tokens=7))
    assert g.ids[1][-1] == 2 and len(g.ids[1]) == 3 and g.finished[1]
    assert g.logprobs[1][-1] == pytest.approx(0.0, abs=1e-3)
    assert all(len(i) == len(lp) for i, lp in zip(g.ids, g.logprobs, strict=True))
