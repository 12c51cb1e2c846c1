"""Performance paths give the same numbers as the plain ones: shared-prompt forward and sampling."""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import GRPOOptions
from mutualrl.rollout.engines import dedupe_prompts
from mutualrl.rollout.policy import Policy


def _policy(path, **kw) -> Policy:
    torch.manual_seed(0)
    pol = Policy("p", str(path), GRPOOptions(num_generations=4, max_completion_length=6, **kw))
    pol.model.eval()  # no dropout: both paths must agree exactly
    return pol


def _rows(pol: Policy) -> tuple[list[list[int]], list[list[int]]]:
    qs = ["What is 12 + 34?", "What is 5 - 3?", "What is 99 + 1?"]
    prompts = [pol.encode_prompt(q) for q in qs]
    g = torch.Generator().manual_seed(1)
    rows_p, rows_c = [], []
    for p in prompts:
        for n in (1, 3, 5, 2):  # ragged completions inside each group
            rows_p.append(p)
            rows_c.append(torch.randint(3, len(pol.tokenizer), (n,), generator=g).tolist())
    return rows_p, rows_c


def test_dedupe_prompts() -> None:
    uniq, inv = dedupe_prompts([[1, 2], [3], [1, 2], [3], [4]])
    assert uniq == [[1, 2], [3], [4]] and inv == [0, 1, 0, 1, 2]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_logprobs_and_grads_match(tiny_models, name, temperature) -> None:
    pol = _policy(tiny_models[name], temperature=temperature)
    prompts, comps = _rows(pol)
    out = {}
    for shared in (False, True):
        pol.share_prompt_prefix = shared
        pol.model.zero_grad(set_to_none=True)
        for width in (None, 8):
            lp = pol.logprobs(prompts, comps, width)
            w = width or 5
            mask = torch.arange(w).unsqueeze(0) >= (w - torch.tensor([len(c) for c in comps])).unsqueeze(1)
            lp = torch.where(mask, lp, torch.zeros_like(lp))
            if width is None:
                (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
            out[(shared, width)] = lp.detach()
        out[(shared, "grad")] = [p.grad.clone() for p in pol.model.parameters() if p.grad is not None]
    for width in (None, 8):
        assert torch.allclose(out[(True, width)], out[(False, width)], atol=1e-5), width
    for a, b in zip(out[(True, "grad")], out[(False, "grad")], strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_shared_prefix_sampling_matches(tiny_models, name) -> None:
    pol = _policy(tiny_models[name])
    prompts = [pol.encode_prompt(q) for q in ["What is 12 + 34?", "What is 5 - 3?"] for _ in range(4)]
    res = {}
    for shared in (False, True):
        pol.share_prompt_prefix = shared
        pol.generator.manual_seed(3)
        res[shared] = pol.generate_ids(prompts)
    assert res[True][0] == res[False][0]
    for a, b in zip(res[True][1], res[False][1], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_bf16_on_cpu_without_native_bf16_warns(tiny_models, monkeypatch) -> None:
    import mutualrl.rollout.policy as mp

    monkeypatch.setattr(mp, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="bfloat16"):
        Policy("p", str(tiny_models["tiny-gpt2"]), GRPOOptions(dtype="bfloat16"))
    monkeypatch.setattr(mp, "cpu_has_native_bf16", lambda: True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        Policy("p", str(tiny_models["tiny-gpt2"]), GRPOOptions(dtype="bfloat16"))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_blocked_logits_match_the_head(bias, softcap) -> None:
    from mutualrl.rollout.engines.head import blocked_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(24, 1000, bias=bias)  # 1000 rows: the last block is partial
    hidden = torch.randn(5, 24)
    want = head(hidden)
    if softcap:
        want = torch.tanh(want / softcap) * softcap
    buf = torch.full((5, 1000), float("nan"))
    got = blocked_logits(head, hidden, block=128, out=buf, softcap=softcap)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_blocked_head_sampling_matches(tiny_models, name) -> None:
    """The engine's blocked LM head samples the same tokens with the same log-probs as the model's
    own forward, sampled and greedy."""
    from mutualrl.rollout.engines import HFEngine, SamplingParams

    pol = _policy(tiny_models[name])
    prompts = [pol.encode_prompt(q) for q in ["What is 12 + 34?", "What is 5 - 3?"]]
    out = {}
    for block in (None, 7):
        eng = HFEngine(pol.model, pol.eos_ids, pol.pad_id, torch.Generator().manual_seed(3), head_block=block)
        for greedy in (False, True):
            out[(block, greedy)] = eng.generate(prompts, 3, SamplingParams(max_new_tokens=6, greedy=greedy))
        assert eng.blocked_head is (block is not None)
    for greedy in (False, True):
        a, b = out[(None, greedy)], out[(7, greedy)]
        assert a.ids == b.ids and a.finished == b.finished
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


def test_blocked_head_falls_back_when_the_model_rescales_its_logits(tiny_models) -> None:
    """A model whose forward changes the head's output (here: halves it) keeps its own forward."""
    from mutualrl.rollout.engines import HFEngine, SamplingParams

    pol = _policy(tiny_models["tiny-llama"])
    model = pol.model
    forward = model.forward

    def halved(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = halved
    prompts = [pol.encode_prompt("What is 12 + 34?")]
    res = {}
    for block in (None, 7):
        eng = HFEngine(model, pol.eos_ids, pol.pad_id, torch.Generator().manual_seed(3), head_block=block)
        res[block] = eng.generate(prompts, 4, SamplingParams(max_new_tokens=5))
        assert eng.blocked_head is False
    assert res[None].ids == res[7].ids and res[None].logprobs == res[7].logprobs
    assert Policy("q", str(tiny_models["tiny-llama"]), GRPOOptions()).engine.head_block  # on by default on CPU


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_decode_mask_4d_matches_the_2d_mask(tiny_models, name) -> None:
    """Decoding with the 4D padding mask samples what the 2D mask samples (ragged, left-padded
    prompts), and the first call switches it on for an SDPA model."""
    from mutualrl.rollout.engines import HFEngine, SamplingParams

    pol = _policy(tiny_models[name])
    prompts = [pol.encode_prompt(q) for q in ["What is 12 + 34?", "5 - 3?", "What is 99 + 1 + 1?"]]
    out = {}
    for four_d in (False, None):
        eng = HFEngine(pol.model, pol.eos_ids, pol.pad_id, torch.Generator().manual_seed(5))
        eng.mask_4d = four_d
        out[four_d] = [eng.generate(prompts, 2, SamplingParams(max_new_tokens=7)) for _ in range(2)]
        if four_d is None:
            assert eng.mask_4d is True
    for a, b in zip(out[False], out[None], strict=True):
        assert a.ids == b.ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


def test_decode_mask_4d_not_used_where_it_is_not_the_same_mask(tiny_models) -> None:
    """Eager attention (an additive float mask) and a sliding window shorter than the sequence keep
    the 2D mask."""
    from mutualrl.rollout.engines import HFEngine, SamplingParams

    pol = _policy(tiny_models["tiny-llama"])
    eng = HFEngine(pol.model, pol.eos_ids, pol.pad_id, torch.Generator().manual_seed(5))
    assert eng._mask_4d_applies(40)
    pol.model.config.sliding_window = 8
    assert not eng._mask_4d_applies(40) and eng._mask_4d_applies(8)
    pol.model.config.sliding_window = None
    pol.model.config._attn_implementation = "eager"
    try:
        assert not eng._mask_4d_applies(40)
        eng.generate([pol.encode_prompt("What is 1 + 2?")], 2, SamplingParams(max_new_tokens=4))
        assert eng.mask_4d is None  # never checked, never used
    finally:
        pol.model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_packed_linears_sample_what_the_plain_layers_sample(tiny_models, name, backend) -> None:
    """Sampling through prepacked weights (MKL's and oneDNN's; GPT-2's Conv1D and Llama's Linear
    layers, the LM head too) draws the same tokens, with log-probs equal to float rounding, greedy
    and sampled; the layers' own forward is back afterwards and training is untouched."""
    from mutualrl.rollout.engines import HFEngine, SamplingParams
    from mutualrl.rollout.engines.packed import packable_linears, packed_linears, packing_available

    if not packing_available(backend):
        pytest.skip(f"this torch build has no {backend} prepacked linear")
    pol = _policy(tiny_models[name])
    layers = packable_linears(pol.model)
    assert len(layers) >= 4  # the blocks' projections and the head
    prompts = [pol.encode_prompt(q) for q in ["What is 12 + 34?", "5 - 3?", "What is 99 + 1 + 1?"]]
    out = {}
    for packed in (False, True):
        eng = HFEngine(pol.model, pol.eos_ids, pol.pad_id, torch.Generator().manual_seed(3), head_block=7,
                       pack_linears=backend if packed else False)
        for greedy in (False, True):
            out[(packed, greedy)] = eng.generate(prompts, 3, SamplingParams(max_new_tokens=6, greedy=greedy))
        assert eng.packed is packed
    for greedy in (False, True):
        a, b = out[(False, greedy)], out[(True, greedy)]
        assert a.ids == b.ids and a.finished == b.finished
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
    assert all("forward" not in vars(m) for m in layers)  # the layers' own forward again
    x = torch.randn(2, 5, pol.model.config.hidden_size)
    with torch.no_grad(), packed_linears(pol.model, 2, backend) as n:
        inside = [m(x) if type(m) is torch.nn.Linear and m.in_features == x.shape[-1] else None for m in layers]
    assert n == len(layers)
    for m, y in zip(layers, inside, strict=True):
        if y is not None:
            assert torch.allclose(y, m(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
def test_packed_linears_fall_back_when_they_do_not_match(tiny_models, monkeypatch, backend) -> None:
    """A packed forward whose logits differ from the model's own is found on the first call and
    the engine keeps the plain layers (what it samples is the plain engine's)."""
    import mutualrl.rollout.engines.packed as packed_mod
    from mutualrl.rollout.engines import HFEngine, SamplingParams

    if not packed_mod.packing_available(backend):
        pytest.skip(f"this torch build has no {backend} prepacked linear")
    pol = _policy(tiny_models["tiny-llama"])
    cls = packed_mod._PACKERS[backend]
    call = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, x: call(self, x) * 1.01)
    prompts = [pol.encode_prompt("What is 12 + 34?")]
    res = {}
    for packed in (False, True):
        eng = HFEngine(pol.model, pol.eos_ids, pol.pad_id, torch.Generator().manual_seed(3),
                       pack_linears=backend if packed else False)
        res[packed] = eng.generate(prompts, 4, SamplingParams(max_new_tokens=5))
        assert eng.packed is False
    assert res[False].ids == res[True].ids and res[False].logprobs == res[True].logprobs
    default = Policy("q", str(tiny_models["tiny-llama"]), GRPOOptions()).engine
    assert default.packed is None and default.pack_backend == packed_mod.default_backend()  # on by default on CPU


def test_mkl_packing_is_bit_for_bit_the_plain_layer() -> None:
    """MKL's packed GEMM gives the plain layer's output: exactly on Intel CPUs (what lets it be
    their default), to float rounding elsewhere."""
    from mutualrl.rollout.engines.packed import cpu_vendor, packed_linears, packing_available

    if not packing_available("mkl"):
        pytest.skip("this torch build has no MKL packed GEMM")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(160, 480), torch.nn.Linear(480, 96, bias=False))
    with torch.no_grad():
        for rows in (1, 3, 16, 40):
            x = torch.randn(rows, 1, 160)
            plain = model(x)
            with packed_linears(model, 16, "mkl"):
                mine = model(x)
            assert torch.allclose(mine, plain, rtol=1e-5, atol=1e-6), rows
            if cpu_vendor() == "GenuineIntel":
                assert torch.equal(mine, plain), rows


def test_default_backend_follows_the_cpu_vendor(monkeypatch) -> None:
    import mutualrl.rollout.engines.packed as packed_mod

    monkeypatch.setattr(packed_mod, "packing_available", lambda backend="onednn": True)
    monkeypatch.setattr(packed_mod, "cpu_vendor", lambda: "GenuineIntel")
    assert packed_mod.default_backend() == "mkl"
    monkeypatch.setattr(packed_mod, "cpu_vendor", lambda: "AuthenticAMD")
    assert packed_mod.default_backend() == "onednn"
    monkeypatch.setattr(packed_mod, "packing_available", lambda backend="onednn": backend == "mkl")
    assert packed_mod.default_backend() == "mkl"  # the other one where only it is there
