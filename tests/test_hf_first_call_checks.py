"""The ``hf`` engine's first-call checks (lean decoding step, blocked LM head, prepacked linears, 4D
mask) compare with the model's own forward at the compute dtype's rounding: under bf16 the fast
path stays on (with fp32's 1e-4 it switched itself off silently), and a check that fails says so,
once, naming itself."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from mutualrl.rollout.engines import hf
from mutualrl.rollout.engines.base import SamplingParams
from mutualrl.rollout.engines.hf import HFEngine, close_enough


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_tolerance_follows_the_compute_dtype():
    ref = torch.tensor([[22.4, -3.0, 0.01, 15.0]])
    half_ulp = ref + torch.tensor([[0.0625, 0.0, 0.0, -0.0625]])  # half a bf16 ulp at 22: two correct orders
    assert close_enough(ref, ref, torch.float32) and close_enough(ref, ref, torch.bfloat16)
    assert not close_enough(half_ulp, ref, torch.float32)
    assert close_enough(half_ulp, ref, torch.bfloat16)
    assert not close_enough(ref + 2.0, ref, torch.bfloat16)  # a wrong fast path is still caught
    assert close_enough(ref + 5e-5, ref, torch.float32)


def _engine(model, tok, autocast=contextlib.nullcontext, **kw) -> HFEngine:
    return HFEngine(model, [tok.eos_token_id], tok.pad_token_id or 0, torch.Generator().manual_seed(0),
                    autocast=autocast, **kw)


@pytest.fixture(scope="module")
def gpt2_add():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mutualrl.zoo.shipped import verified_dir

    d = verified_dir("gpt2-add")
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), AutoTokenizer.from_pretrained(d)


def _prompts(tok):
    return [tok("Calculate 54 - 23. Answer: ")["input_ids"], tok("Calculate 1 + 2. Answer: ")["input_ids"]]


def test_the_compute_dtype_is_the_autocast_one(gpt2_add):
    model, tok = gpt2_add
    assert _engine(model, tok).compute_dtype() == torch.float32
    assert _engine(model, tok, _bf16).compute_dtype() == torch.bfloat16


def test_under_bf16_the_lean_step_passes_its_check(gpt2_add, monkeypatch):
    """The zoo's GPT-2 under bf16 autocast: the lean step's first-step logits are half a bf16 ulp
    (0.0625 at logits near 22) from the model's forward, which the fp32 tolerance refused."""
    model, tok = gpt2_add
    monkeypatch.setattr(hf, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no check fails
        eng = _engine(model, tok, _bf16, lean_step=True)
        out = eng.generate(_prompts(tok), 4, SamplingParams(8, 1.0, 1.0, False))
    assert eng.lean is True
    assert all(len(ids) == len(lps) for ids, lps in zip(out.ids, out.logprobs, strict=True))


def test_a_failing_check_warns_once_naming_itself(gpt2_add, monkeypatch):
    model, tok = gpt2_add
    monkeypatch.setattr(hf, "_warned", set())
    monkeypatch.setattr(hf, "close_enough", lambda mine, ref, dtype: False)
    engines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a second engine of the process does not warn again
            engines.append(_engine(model, tok, lean_step=True, head_block=4096))
            engines[-1].generate(_prompts(tok), 2, SamplingParams(4, 1.0, 1.0, False))
    assert all(e.lean is False and e.blocked_head is False for e in engines)
    names = [str(w.message) for w in caught if "HFEngine" in str(w.message)]
    assert len(names) == 2, names
    assert any("lean decoding step" in n for n in names) and any("blocked LM head" in n for n in names)
    assert all("float32" in n for n in names)
