"""Policy: KV-cache sampling with behavior log-probs, and right-aligned training log-probs."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from mutualrl.config import GRPOOptions
from mutualrl.rollout.engines.base import top_p_filter as _top_p_filter
from mutualrl.rollout.policy import Policy
from mutualrl.rollout.token_tensors import pack_right, right_mask

QUESTIONS = ["Calculate 12 + 34.", "Calculate 98 - 7 and then think about it for a while.", "1+1"]
MODELS = ["tiny-gpt2", "tiny-llama"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policies(tiny_models):
    return {name: Policy(name, str(tiny_models[name]), GRPOOptions(max_completion_length=7), seed=0)
            for name in MODELS}


def _recompute(pol: Policy, samples):
    w = max(len(s.completion_ids) for s in samples)
    with torch.no_grad():
        lp = pol.logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    assert lp.shape == (len(samples), w)
    old = pack_right([s.logprobs for s in samples], w)
    mask = right_mask([len(s.completion_ids) for s in samples], w)
    return lp, old, mask


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_match_recomputed(policies, name, temperature):
    pol = policies[name]
    pol.options.temperature = temperature
    try:
        samples = pol.generate(QUESTIONS, 3)
        assert len(samples) == 9
        assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        lp, old, mask = _recompute(pol, samples)
        diff = ((lp - old).abs() * mask).max().item()
        assert diff < 1e-4
        assert all(all(x <= 0 for x in s.logprobs) for s in samples)
        assert all(len(s.logprobs) == len(s.completion_ids) for s in samples)
        # the temperature really is applied (otherwise the two log-prob sets would differ)
        if temperature != 1.0:
            pol.options.temperature = 1.0
            with torch.no_grad():
                lp1 = pol.logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
            assert ((lp1 - old).abs() * mask).max().item() > 1e-3
    finally:
        pol.options.temperature = 1.0


@pytest.mark.parametrize("name", MODELS)
def test_max_completion_length_and_seeded_sampling(policies, tiny_models, name):
    pol = policies[name]
    samples = pol.generate(QUESTIONS, 2)
    assert all(len(s.completion_ids) <= 7 for s in samples)
    assert all(len(s.completion_ids) == 7 for s in samples if not s.finished)
    short = pol.generate_ids([samples[0].prompt_ids], max_new_tokens=2)[0][0]
    assert len(short) <= 2
    # a second policy with the same seed samples the same completions
    twin = Policy(name, str(tiny_models[name]), GRPOOptions(max_completion_length=7), seed=0)
    pol.generator.manual_seed(123)
    twin.generator.manual_seed(123)
    assert [s.completion_ids for s in pol.generate(QUESTIONS, 2)] == \
        [s.completion_ids for s in twin.generate(QUESTIONS, 2)]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_is_deterministic_argmax(policies, name):
    pol = policies[name]
    a = pol.generate(QUESTIONS, greedy=True)
    b = pol.generate(QUESTIONS, greedy=True, batch_size=1)
    assert len(a) == len(QUESTIONS)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    # each greedy token is the argmax of a full forward over the prefix
    s = a[1]
    seq = list(s.prompt_ids)
    with torch.no_grad():
        for tok in s.completion_ids:
            logits = pol.model(input_ids=torch.tensor([seq])).logits[0, -1]
            assert tok == int(logits.argmax())
            seq.append(tok)


@pytest.mark.parametrize("name", MODELS)
def test_generation_stops_at_eos(policies, name):
    pol = policies[name]
    eos = pol.tokenizer.eos_token_id
    orig = pol.model.forward
    calls = {"n": 0}

    @functools.wraps(orig)
    def forced(*args, **kwargs):
        out = orig(*args, **kwargs)
        calls["n"] += 1
        # row 0 ends at its 1st token, row 1 at its 3rd, row 2 never
        if calls["n"] == 1:
            out.logits[0, -1, eos] += 1e4
        if calls["n"] == 3:
            out.logits[1, -1, eos] += 1e4
        return out

    pol.model.forward = forced
    # steer the model's own forward (not the blocked head's or the lean step's), one call per step
    eng = pol.engine
    saved = eng.blocked_head, eng.lean, eng.mask_4d, eng.packed
    eng.blocked_head, eng.lean, eng.mask_4d, eng.packed = False, False, False, False
    try:
        ids, lps, fin = pol.generate_ids([pol.encode_prompt(q) for q in QUESTIONS])
    finally:
        del pol.model.forward
        eng.blocked_head, eng.lean, eng.mask_4d, eng.packed = saved
    assert ids[0] == [eos] and fin[0]
    assert len(ids[1]) == 3 and ids[1][-1] == eos and fin[1]
    assert len(ids[2]) == 7 and not fin[2] and eos not in ids[2]
    assert lps[0][0] == pytest.approx(0.0, abs=1e-3)  # forced EOS has probability ~1
    assert all(len(a) == len(b) for a, b in zip(ids, lps))


def _naive_logprobs(pol: Policy, prompt, completion):
    with torch.no_grad():
        logits = pol.model(input_ids=torch.tensor([list(prompt) + list(completion)])).logits[0].float()
    logits = logits / pol.options.temperature
    lp = F.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("name", MODELS)
def test_logprobs_right_aligned_layout(policies, name):
    pol = policies[name]
    g = torch.Generator().manual_seed(0)
    vocab = len(pol.tokenizer)
    prompts = [pol.encode_prompt(q) for q in QUESTIONS] + [[5]]
    comps = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 1, 6, 2)]
    for width in (None, 6, 9, 15):
        with torch.no_grad():
            lp = pol.logprobs(prompts, comps, width)
        w = width or 6
        assert lp.shape == (4, w)
        for i, (p, c) in enumerate(zip(prompts, comps)):
            ref = _naive_logprobs(pol, p, c)
            assert torch.allclose(lp[i, w - len(c):], ref, atol=1e-4), (width, i)


def test_logprobs_carry_gradient_and_reference(tiny_models):
    pol = Policy("r", str(tiny_models["tiny-llama"]), GRPOOptions(beta=0.1, learning_rate=0.05), seed=0)
    p, c = [pol.encode_prompt("Calculate 3 + 4.")], [pol.encode_completion(None, "7")]
    lp = pol.logprobs(p, c)
    assert lp.requires_grad
    ref = pol.logprobs(p, c, reference=True)
    assert not ref.requires_grad
    assert torch.allclose(lp.detach(), ref, atol=1e-6)
    (-lp.sum()).backward()
    pol.optimizer.step()
    with torch.no_grad():
        assert float(pol.logprobs(p, c).sum()) > float(ref.sum())
    assert torch.equal(pol.logprobs(p, c, reference=True), ref)  # the reference stays frozen
    no_ref = Policy("n", str(tiny_models["tiny-llama"]), GRPOOptions(), seed=0)
    with pytest.raises(RuntimeError, match="reference"):
        no_ref.logprobs(p, c, reference=True)


def test_prompt_and_completion_encoding(policies):
    for pol in policies.values():
        ids = pol.encode_prompt("Calculate 3 + 4.")
        assert ids and ids[-1] not in pol.eos_ids
        comp = pol.encode_completion(None, "7")
        assert comp[-1] == pol.tokenizer.eos_token_id
        assert pol.tokenizer.decode(comp, skip_special_tokens=True).strip() == "7"


def test_top_p_filter_renormalises_the_nucleus():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = _top_p_filter(p.log(), 0.7)
    assert out.exp()[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    out = _top_p_filter(p.log(), 0.45)  # the top token alone covers 0.45
    assert out.exp()[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0], abs=1e-6)
    assert math.isclose(float(_top_p_filter(p.log(), 1.0).exp().sum()), 1.0, rel_tol=1e-6)
