"""Sharing strategies: batch construction on hand-made rows, PRP chunk weights, the update."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.algorithms.sharing import (
    OwnGroup,
    PeerRows,
    ShareContext,
    TrainBatch,
    TrainRow,
    available_strategies,
    build_batch,
    check_strategy_name,
    parse_strategy,
    register_strategy,
)
from mutualrl.algorithms.strategies.prp import PRPSettings, chunk_weights
from mutualrl.algorithms.update import train_on_batch
from mutualrl.config import GRPOOptions
from mutualrl.experience import Rollout, VerifiedSuccess

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def task(small_zoo_task):
    return small_zoo_task


def _wrong(answer: str) -> str:
    return str(int(answer) + 1)


def _group(problem, rewards, prompt_len=3, comp_len=2, scores=None):
    g = len(rewards)
    return OwnGroup(problem, list(range(100, 100 + prompt_len)),
                    [[10 + i] * comp_len for i in range(g)], [[-0.5] * comp_len for _ in range(g)],
                    list(rewards), list(rewards if scores is None else scores))


def _encode(prompt_ids, text: str) -> list[int]:
    return [ord(c) for c in text] + [0]


def _align(r: Rollout, prompt_ids=()):
    """A fake THL: one learner token per character, one chunk per two characters."""
    from mutualrl.thl.peer import PeerTrace

    if r.completion == "REFUSE":
        return PeerTrace(refused="unrepresentable")
    ids = [ord(c) for c in r.completion]
    chunks = [(a, min(a + 2, len(ids)), -1.0) for a in range(0, len(ids), 2)]
    return PeerTrace(ids, chunks, {"chunks": float(len(chunks)), "noncanonical": 0.0})


def _ctx(task, groups, records=(), *, options=None, blocks=None):
    """A context of ``groups`` and peer ``records``; ``blocks``: the ``sharing.<step>`` blocks _build uses."""
    ctx = ShareContext(groups, PeerRows.from_records(list(records)), options or GRPOOptions(dynamic_sampling="off"),
                       _scorer(task), _encode, _align)
    ctx.sharing_blocks = blocks  # what _build passes on
    return ctx


def _build(strategy, ctx):
    return build_batch(strategy, ctx, getattr(ctx, "sharing_blocks", None))


def _scorer(task):
    return lambda problems, completions: task.rewards(problems, [p.question for p in problems], completions)


def _peer_group(problem, rewards, source="peer"):
    """A peer's rollouts for ``problem`` whose texts the verifier scores as ``rewards`` (1: the answer)."""
    return [_rollout(problem, problem.answer if r else _wrong(problem.answer), r, source, i)
            for i, r in enumerate(rewards)]


def _rollout(problem, text, reward=0.0, source="peer", idx=0):
    return Rollout(problem.id, problem.question, text, source, "tok-peer", [1] * len(text), [-0.3] * len(text),
                   reward, 0, idx)


def _success(problem, text, source="peer"):
    return VerifiedSuccess(problem.id, text, source, "add:verifier", 1.0, 0)


# ----------------------------------------------------------------------------- names
def test_registry_and_strategy_names():
    assert {"independent", "prp", "xgrpo", "sgt"} <= set(available_strategies())
    for ok in ("independent", "prp", "xgrpo", "sgt", "xgrpo+sgt", "prp+sgt", " sgt + xgrpo "):
        assert check_strategy_name(ok) is None, ok
    err = check_strategy_name("xgrpoo")
    assert err and "did you mean 'xgrpo'" in err
    assert "unknown strategy" in (check_strategy_name("sgt+foo") or "")
    assert check_strategy_name("prp+xgrpo")
    assert check_strategy_name("independent+sgt")
    assert "twice" in (check_strategy_name("sgt+sgt") or "")
    assert check_strategy_name("")


# ----------------------------------------------------------------------------- dynamic sampling
def test_skip_leaves_out_zero_advantage_rows_after_every_step_had_its_say(task):
    p0, p1, p2 = task.problems("train", 3)
    groups = [_group(p0, [1, 0, 0, 1]), _group(p1, [1, 1, 1, 1]), _group(p2, [0, 0, 0, 0])]
    skip = GRPOOptions(dynamic_sampling="skip")
    batch = _build("independent", _ctx(task, groups, options=skip))
    assert len(batch.rows) == 4 and batch.metrics["zero_adv_rows_skipped"] == 8
    assert batch.n_prompts == 3  # the rescue term's denominator still counts every prompt
    # XGRPO gives the all-fail group a signal from the peer's rewards: its rows stay
    peer = [*_peer_group(p2, [1.0, 0.0])]
    batch = _build("xgrpo", _ctx(task, groups, peer, options=skip))
    assert len(batch.rows) == 8 and batch.metrics["zero_adv_rows_skipped"] == 4


# ----------------------------------------------------------------------------- independent / xgrpo
def test_independent_uses_own_group_advantages(task):
    p0, p1 = task.problems("train", 2)
    batch = _build("independent", _ctx(task, [_group(p0, [1, 0, 0, 1]), _group(p1, [1, 1, 1, 1])]))
    assert [r.kind for r in batch.rows] == ["own"] * 8
    assert [r.advantage for r in batch.rows[:4]] == pytest.approx([0.8658754, -0.8658754, -0.8658754, 0.8658754])
    assert [r.advantage for r in batch.rows[4:]] == [0.0] * 4
    assert batch.metrics["zero_var_group_frac"] == 0.5
    assert batch.rows[0].old_logprobs == [-0.5, -0.5]
    assert batch.rows[0].prompt_ids == [100, 101, 102]


def test_xgrpo_advantages_equal_the_pooled_formula_and_train_only_own_rows(task):
    p0, p1 = task.problems("train", 2)
    peers = [*_peer_group(p0, [1.0, 1.0, 0.0, 0.0]), _success(p0, p0.answer)]
    ctx = _ctx(task, [_group(p0, [1, 0, 0, 0]), _group(p1, [1, 0, 0, 1])], peers)
    batch = _build("xgrpo", ctx)
    assert all(r.kind == "own" for r in batch.rows) and len(batch.rows) == 8
    # pool [1,0,0,0,1,1,0,0]: mean 3/8, unbiased std 0.5175492 -> (r - 0.375) / (0.5175492 + 1e-4)
    assert [r.advantage for r in batch.rows[:4]] == pytest.approx([1.2073814, -0.7244289, -0.7244289, -0.7244289],
                                                                  abs=1e-6)
    # p1 has no peer outcome: its own-group advantages stay
    assert [r.advantage for r in batch.rows[4:]] == pytest.approx([0.8658754, -0.8658754, -0.8658754, 0.8658754])
    assert batch.metrics["xgrpo_pooled_prompts"] == 1
    assert batch.metrics["xgrpo_peer_rewards"] == 4


def test_xgrpo_gives_signal_to_a_zero_variance_group(task):
    # own group all 0 (no GRPO signal); a peer solved it: pooled baseline makes own advantages negative
    (p0,) = task.problems("train", 1)
    ctx = _ctx(task, [_group(p0, [0, 0])], [*_peer_group(p0, [1.0, 0.0])])
    adv = [r.advantage for r in _build("xgrpo", ctx).rows]
    # pool [0,0,1,0]: mean 0.25, std 0.5 -> -0.25 / 0.5001
    assert adv == pytest.approx([-0.25 / 0.5001] * 2)


def test_batch_scale_is_over_the_pooled_batch(task):
    """scale_rewards=batch with a zero-variance own batch: the scale comes from the pooled rewards
    (own + peers), not from the own batch alone (which would divide by eps: advantages of -2500)."""
    (p0,) = task.problems("train", 1)
    opts = GRPOOptions(scale_rewards="batch")
    ctx = _ctx(task, [_group(p0, [0, 0])], [*_peer_group(p0, [1.0, 0.0])], options=opts)
    # pooled batch [0, 0, 1, 0]: mean 0.25, unbiased std 0.5
    assert [r.advantage for r in _build("xgrpo", ctx).rows] == pytest.approx([-0.25 / 0.5001] * 2)
    ctx = _ctx(task, [_group(p0, [0, 0])], [_rollout(p0, p0.answer, idx=0), _rollout(p0, "x", idx=1)],
               options=opts)
    batch = _build("prp", ctx)
    assert [r.advantage for r in batch.rows] == pytest.approx([-0.25 / 0.5001, -0.25 / 0.5001,
                                                               0.75 / 0.5001, -0.25 / 0.5001])
    assert max(abs(r.advantage) for r in batch.rows) < 2


# ----------------------------------------------------------------------------- sgt
def test_sgt_gate_closed_when_own_group_has_a_success(task):
    (p0,) = task.problems("train", 1)
    ctx = _ctx(task, [_group(p0, [1, 0, 0, 0])], [_success(p0, p0.answer)])
    batch = _build("sgt", ctx)
    assert [r.kind for r in batch.rows] == ["own"] * 4
    assert batch.metrics["sgt_gate_open"] == 0
    assert batch.metrics["sgt_rescue"] == 0


def test_sgt_refuses_a_peer_success_that_fails_reverification(task):
    (p0,) = task.problems("train", 1)
    ctx = _ctx(task, [_group(p0, [0, 0, 0, 0])], [_success(p0, _wrong(p0.answer))])
    batch = _build("sgt", ctx)
    assert all(r.kind == "own" for r in batch.rows)
    assert batch.metrics["sgt_gate_open"] == 1
    assert batch.metrics["sgt_rescue"] == 0
    assert batch.metrics["sgt_refused"] == 1


def test_sgt_adds_one_rescue_row_when_open_and_verified(task):
    (p0,) = task.problems("train", 1)
    good = p0.answer
    records = [_success(p0, _wrong(p0.answer)), _success(p0, good), _success(p0, good + "\n")]
    ctx = _ctx(task, [_group(p0, [0, 0, 0, 0])], records, blocks={"sgt": {"weight": 0.3}})
    batch = _build("sgt", ctx)
    rescue = [r for r in batch.rows if r.kind == "rescue"]
    assert len(rescue) == 1
    assert rescue[0].weight == 0.3
    assert rescue[0].completion_ids == _encode(None, good)
    assert rescue[0].prompt_ids == [100, 101, 102]
    assert batch.metrics["sgt_rescue"] == 1
    assert batch.metrics["sgt_refused"] == 1  # the wrong one, seen before the good one


def test_sgt_respects_max_per_step(task):
    probs = task.problems("train", 3)
    groups = [_group(p, [0, 0]) for p in probs]
    records = [_success(p, p.answer) for p in probs]
    batch = _build("sgt", _ctx(task, groups, records, blocks={"sgt": {"max_rows": 2}}))
    assert sum(r.kind == "rescue" for r in batch.rows) == 2
    assert batch.metrics["sgt_gate_open"] == 3
    batch0 = _build("sgt", _ctx(task, groups, records, blocks={"sgt": {"max_rows": 0}}))
    assert sum(r.kind == "rescue" for r in batch0.rows) == 0


def test_xgrpo_plus_sgt_chains_both(task):
    p0, p1 = task.problems("train", 2)
    records = [*_peer_group(p0, [1.0, 0.0]), _success(p0, p0.answer),
               *_peer_group(p1, [1.0, 1.0])]
    batch = _build("xgrpo+sgt", _ctx(task, [_group(p0, [0, 0]), _group(p1, [1, 0])], records))
    assert [r.kind for r in batch.rows] == ["own"] * 4 + ["rescue"]
    assert batch.metrics["xgrpo_pooled_prompts"] == 2
    assert batch.metrics["sgt_rescue"] == 1
    # p0 pooled [0,0,1,0] -> -0.25/0.5001; p1 pooled [1,0,1,1] -> mean .75, std .5
    assert [r.advantage for r in batch.rows[:4]] == pytest.approx(
        [-0.25 / 0.5001, -0.25 / 0.5001, 0.25 / 0.5001, -0.75 / 0.5001])


# ----------------------------------------------------------------------------- prp
def test_prp_adds_reverified_peer_rows_with_pooled_advantages(task):
    (p0,) = task.problems("train", 1)
    # the peer claims reward 1 for a wrong answer and 0 for the right one: the learner re-verifies
    records = [_rollout(p0, p0.answer, 0.0, idx=0), _rollout(p0, _wrong(p0.answer), 1.0, idx=1),
               _rollout(p0, "REFUSE", 1.0, idx=2)]
    ctx = _ctx(task, [_group(p0, [1, 0, 0, 0])], records, blocks={"prp": {"weight": 0.25, "max_per_prompt": 3}})
    batch = _build("prp", ctx)
    own = [r for r in batch.rows if r.kind == "own"]
    peer = [r for r in batch.rows if r.kind == "peer"]
    assert len(own) == 4 and len(peer) == 2
    # pool [1,0,0,0, 1,0]: mean 1/3, unbiased std 0.5163978
    hi, lo = 1.2907445, -0.6453722
    assert [r.advantage for r in own] == pytest.approx([hi, lo, lo, lo], abs=1e-6)
    assert [r.advantage for r in peer] == pytest.approx([hi, lo], abs=1e-6)
    assert peer[0].completion_ids == [ord(c) for c in p0.answer]
    assert peer[0].peer_chunks == _align(records[0]).chunks
    assert peer[0].old_logprobs is None
    assert all(r.weight == 0.25 for r in peer)
    assert batch.metrics["prp_peer_samples"] == 2
    assert batch.metrics["prp_refused"] == 1


def test_prp_caps_peers_per_prompt(task):
    (p0,) = task.problems("train", 1)
    records = [_rollout(p0, p0.answer, idx=i, source=f"peer{i}") for i in range(5)]
    batch = _build("prp", _ctx(task, [_group(p0, [0, 0])], records, blocks={"prp": {"max_per_prompt": 2}}))
    assert sum(r.kind == "peer" for r in batch.rows) == 2


def test_prp_needs_thl(task):
    (p0,) = task.problems("train", 1)
    ctx = _ctx(task, [_group(p0, [0, 1])])
    ctx.align_peer = None
    with pytest.raises(RuntimeError, match="THL"):
        _build("prp", ctx)


def test_chunk_weights_are_truncated_chunk_ratios():
    width = 5
    own = TrainRow([1], [5, 6, 7], 0.5, [-1.0, -1.0, -1.0])
    peer = TrainRow([1], [8, 9, 10, 11], 1.0, None, "peer", [(0, 1, -1.0), (1, 3, -2.5), (3, 4, -0.2)])
    cur = torch.tensor([[0.0, 0.0, -3.0, -3.0, -3.0],
                        [0.0, -1.5, -1.0, -1.0, -0.1]])
    # chunk log-ratios: -1.5 - (-1.0) = -0.5; -2.0 - (-2.5) = 0.5; -0.1 - (-0.2) = 0.1
    w, stats = chunk_weights([own, peer], cur, width, PRPSettings(ratio_clip=1.0))
    assert w[0].tolist() == [1.0] * 5
    assert w[1].tolist() == pytest.approx([1.0, math.exp(-0.5), 1.0, 1.0, 1.0])
    assert stats["prp_ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-5)
    assert stats["prp_ratio_mean"] == pytest.approx((math.exp(-0.5) + math.exp(0.5) + math.exp(0.1)) / 3, rel=1e-5)
    assert stats["prp_ratio_truncated_frac"] == pytest.approx(2 / 3)
    # ESS fraction of the truncated weights [e^-0.5, 1, 1]: (sum)^2 / (n * sum of squares)
    assert stats["prp_ess_frac"] == pytest.approx(0.9564116, abs=1e-6)
    w2, stats2 = chunk_weights([own, peer], cur, width, PRPSettings(ratio_clip=1.2))
    # both chunk-1 tokens carry the chunk's weight
    assert w2[1].tolist() == pytest.approx([1.0, math.exp(-0.5), 1.2, 1.2, math.exp(0.1)], rel=1e-6)
    assert stats2["prp_ratio_truncated_frac"] == pytest.approx(1 / 3)


# ----------------------------------------------------------------------------- the update
@pytest.fixture(scope="module")
def gpt2_policy(tiny_models):
    from mutualrl.rollout.policy import Policy

    return Policy("a", str(tiny_models["tiny-gpt2"]),
                  GRPOOptions(num_generations=2, max_completion_length=12, learning_rate=3e-2), seed=0)


def test_sgt_rescue_term_raises_the_likelihood_of_the_success(gpt2_policy):
    pol = gpt2_policy
    prompt = pol.encode_prompt("Calculate 12 + 30.")
    target = pol.encode_completion(None, "42")
    batch = TrainBatch([TrainRow(prompt, target, 0.0, None, "rescue", None, 1.0)], kinds=parse_strategy("sgt").kinds())

    def nll() -> float:
        with torch.no_grad():
            return -float(pol.logprobs([prompt], [target]).sum())

    before = nll()
    for _ in range(5):
        stats = train_on_batch(pol, batch)
    assert "rescue_nll" in stats and math.isfinite(stats["loss"])
    assert nll() < before - 0.5


def test_update_mixes_long_own_rows_short_rescue_and_peer_rows(gpt2_policy):
    """Rows of very different lengths in one batch (a rescue row shorter than the batch width)."""
    pol = gpt2_policy
    prompt = pol.encode_prompt("Calculate 1 + 2.")
    long = [pol.tokenizer.convert_tokens_to_ids("1")] * 12
    with torch.no_grad():
        lp = pol.logprobs([prompt, prompt], [long, long[:5]])
    own1 = TrainRow(prompt, long, 1.0, lp[0].tolist())
    own2 = TrainRow(prompt, long[:5], -1.0, lp[1, -5:].tolist())
    peer_ids = pol.encode_completion(None, "3")
    peer = TrainRow(prompt, peer_ids, 1.0, None, "peer", [(0, len(peer_ids) - 1, -2.0),
                                                            (len(peer_ids) - 1, len(peer_ids), -0.1)], 0.5)
    rescue = TrainRow(prompt[-1:], pol.encode_completion(None, "3"), 0.0, None, "rescue", None, 0.1)
    kinds = parse_strategy("prp+sgt").kinds({"prp": {"ratio_clip": 1.0}})
    stats = train_on_batch(pol, TrainBatch([own1, own2, peer, rescue], kinds=kinds))
    for k in ("prp_ratio_mean", "prp_ess_frac", "rescue_nll", "pg_loss", "grad_norm", "loss"):
        assert math.isfinite(stats[k]), k
    assert 0 < stats["prp_ess_frac"] <= 1.0


def test_own_rows_logprob_mismatch_is_zero_at_first_iteration(gpt2_policy):
    pol = gpt2_policy
    prompt = pol.encode_prompt("Calculate 5 + 5.")
    samples = pol.generate(["Calculate 5 + 5."], 2)
    rows = [TrainRow(s.prompt_ids, s.completion_ids, a, s.logprobs) for s, a in zip(samples, [1.0, -1.0])]
    assert rows[0].prompt_ids == prompt
    stats = train_on_batch(pol, TrainBatch(rows))
    assert stats["logprob_mismatch_max"] < 1e-4
    assert stats["clip_frac"] == 0.0


# ----------------------------------------------------------------------------- THL peer traces -> PRP weights
@pytest.fixture(scope="module")
def llama_policy(tiny_models):
    from mutualrl.rollout.policy import Policy

    return Policy("b", str(tiny_models["tiny-llama"]), GRPOOptions(num_generations=2, max_completion_length=12),
                  seed=1)


def test_prp_weights_equal_thl_chunk_ratios_truncated(gpt2_policy, llama_policy):
    """A peer (Llama/Unigram) completion mapped by THL onto the learner (GPT-2/byte BPE): chunks tile
    the learner tokens, keep the peer's total log-prob, and the PRP weight of every token is
    min(exp(sum of learner log-probs over its chunk - peer chunk sum), c)."""
    from mutualrl.thl.peer import peer_trace

    learner, peer = gpt2_policy, llama_policy
    text = "42 is the Answer"
    q = "Calculate 12 + 30."
    peer_ids = peer.encode_completion(None, text)
    with torch.no_grad():
        peer_lps = peer.logprobs([peer.encode_prompt(q)], [peer_ids])[0].tolist()
    res = peer_trace(text, peer_ids, peer_lps, peer.tokenizer, learner.tokenizer)
    assert not res.refused
    ids, chunks, residual = res.ids, res.chunks, res.residual
    assert ids == learner.encode_completion(None, text)
    assert residual["noncanonical"] == 0.0 and residual["chunks"] == len(chunks)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(ids)
    assert all(a < b for a, b, _ in chunks)
    assert all(chunks[k][1] == chunks[k + 1][0] for k in range(len(chunks) - 1))
    assert sum(s for _, _, s in chunks) == pytest.approx(sum(peer_lps), abs=1e-5)
    assert chunks[-1] == (len(ids) - 1, len(ids), pytest.approx(peer_lps[-1]))  # EOS maps to EOS

    prompt = learner.encode_prompt(q)
    row = TrainRow(prompt, ids, 1.0, None, "peer", chunks, 0.5)
    width = len(ids) + 3
    with torch.no_grad():
        cur = learner.logprobs([prompt], [ids], width)
    for clip in (1.0, 50.0):
        w, stats = chunk_weights([row], cur, width, PRPSettings(ratio_clip=clip))
        off = width - len(ids)
        assert w[0, :off].tolist() == [1.0] * off
        ratios = []
        for a, b, s in chunks:
            r = math.exp(float(cur[0, off + a:off + b].sum()) - s)
            ratios.append(r)
            assert w[0, off + a:off + b].tolist() == pytest.approx([min(r, clip)] * (b - a), rel=1e-5)
        assert stats["prp_ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
        assert float(w.max()) <= clip


def test_peer_trace_noncanonical_ids_become_one_sequence_chunk(gpt2_policy, llama_policy):
    from mutualrl.thl.peer import peer_trace

    src, tgt = gpt2_policy.tokenizer, llama_policy.tokenizer
    text = "Answer"
    canonical = src(text, add_special_tokens=False)["input_ids"]
    chars = [src.convert_tokens_to_ids(c) for c in text]
    assert chars != canonical and src.unk_token_id not in chars
    tr = peer_trace(text, chars + [src.eos_token_id], [-0.5] * 7, src, tgt)
    assert tr.residual["noncanonical"] == 1.0
    n = len(tr.ids) - 1
    assert tr.chunks == [(0, n, pytest.approx(-3.0)), (n, n + 1, -0.5)]
    assert tr.ids[-1] == tgt.eos_token_id
    # lengths that disagree are refused
    assert peer_trace(text, chars, [-0.5] * 3, src, tgt).refused == "length_mismatch"


def test_update_with_several_iterations_and_kl(tiny_models):
    """num_iterations reuses the stored old log-probs: the second iteration sees ratios != 1 and a
    positive KL to the frozen reference."""
    from mutualrl.rollout.policy import Policy

    pol = Policy("k", str(tiny_models["tiny-gpt2"]),
                 GRPOOptions(num_generations=4, max_completion_length=5, learning_rate=5e-2, beta=0.1,
                             num_iterations=3), seed=0)
    samples = pol.generate(["Calculate 5 + 5.", "Calculate 7 - 2."], 4)
    rows = [TrainRow(s.prompt_ids, s.completion_ids, a, s.logprobs)
            for s, a in zip(samples, [1.0, -1.0, 0.5, -0.5] * 2)]
    stats = train_on_batch(pol, TrainBatch(rows))
    assert stats["logprob_mismatch_max"] < 1e-4
    assert stats["kl"] > 0  # measured at the last iteration, after two optimizer steps
    assert abs(stats["ratio_mean"] - 1.0) > 1e-4


# ----------------------------------------------------------------------------- the registry
PROBE_SEEN: list[dict[str, int]] = []


@register_strategy("probe_outcomes", reads=("group_outcome",))
def _probe_outcomes(ctx, batch):
    """A user-registered step: records what the worker handed it."""
    PROBE_SEEN.append({"rollout": sum(map(len, ctx.peers.rollouts.values())),
                       "group_outcome": sum(map(len, ctx.peers.outcomes.values())),
                       "verified_success": sum(map(len, ctx.peers.successes.values()))})


def test_a_registered_step_receives_exactly_the_kinds_it_declares(tiny_config):
    from mutualrl.run.trainer import MutualTrainer

    cfg = dict(tiny_config, steps=2, eval_every=100, checkpoint_every=100,
               sharing={"strategy": "probe_outcomes"})
    PROBE_SEEN.clear()
    MutualTrainer(cfg, None, progress=False).train()
    assert len(PROBE_SEEN) == 4  # 2 policies x 2 steps
    # each peer published 4 prompts' outcomes (and rollouts and successes, which it must not see)
    assert all(s == {"rollout": 0, "group_outcome": 4, "verified_success": 0} for s in PROBE_SEEN), PROBE_SEEN
    assert parse_strategy("probe_outcomes+sgt").reads == {"group_outcome", "verified_success"}


def test_registry_declarations_are_enforced():
    with pytest.raises(ValueError, match="already registered"):
        register_strategy("sgt")(lambda ctx, batch: None)
    with pytest.raises(ValueError, match="unknown record kinds"):
        register_strategy("bad_reads", reads=("rollouts",))
    with pytest.raises(ValueError, match="lower-case"):
        register_strategy("Bad+Name")
    # declared properties, not substrings, decide: 'sgt_strict' is not 'sgt', two poolers conflict
    assert check_strategy_name("sgt_strict") and "unknown strategy" in check_strategy_name("sgt_strict")
    assert "both provide pooled advantages" in check_strategy_name("prp+xgrpo")
    assert parse_strategy("independent").reads == frozenset() and not parse_strategy("independent").shares
    assert parse_strategy("prp").reads == {"rollout"} and parse_strategy("xgrpo").reads == {"rollout"}


# ----------------------------------------------------------------------------- guide / imitate
def test_guide_puts_a_verified_peer_success_into_a_failed_group(task):
    p0, p1 = task.problems("train", 2)
    records = [_success(p0, _wrong(p0.answer)), _success(p0, p0.answer), _success(p1, p1.answer)]
    ctx = _ctx(task, [_group(p0, [0, 0, 0, 0]), _group(p1, [1, 0, 0, 0])], records)
    batch = _build("guide", ctx)
    guide = [r for r in batch.rows if r.kind == "guide"]
    assert len(guide) == 1 and guide[0].completion_ids == _encode(None, p0.answer)
    # pooled group [0, 0, 0, 0, 1]: mean 0.2, unbiased std 0.4472136
    own0 = [r for r in batch.rows if r.kind == "own"][:4]
    assert [r.advantage for r in own0] == pytest.approx([-0.2 / (0.4472136 + 1e-4)] * 4, rel=1e-6)
    assert guide[0].advantage == pytest.approx(0.8 / (0.4472136 + 1e-4), rel=1e-6)
    assert batch.metrics["guide_rows"] == 1 and batch.metrics["guide_refused"] == 1  # the wrong one
    assert batch.metrics["peer_rows"] == 1 and batch.metrics["peer_rows/peer"] == 1
    # p1's group had a success: no guidance there unless the gate allows it
    gated = _build("guide", _ctx(task, ctx.groups, records, blocks={"guide": {"gate": 0.25}}))
    assert gated.metrics["guide_rows"] == 2


def test_guide_rows_train_off_policy_with_shaping(gpt2_policy):
    from mutualrl.algorithms.strategies.guide import GuideSettings, shaping_weights

    cur = torch.log(torch.tensor([[0.01, 0.1, 0.9]]))
    assert torch.equal(shaping_weights([], cur, 3, GuideSettings())[0], torch.ones_like(cur))
    w = shaping_weights([], cur, 3, GuideSettings(shaping_gamma=0.1))[0]  # LUFFY: gamma p / (p + gamma)^2, max at gamma
    assert w[0, 1] == pytest.approx(0.25) and w[0, 0] < w[0, 1] and w[0, 2] < w[0, 1]
    pol = gpt2_policy
    prompt = pol.encode_prompt("Calculate 12 + 30.")
    row = TrainRow(prompt, pol.encode_completion(None, "42"), 2.0, None, "guide", None, 1.0)

    def nll() -> float:
        with torch.no_grad():
            return -float(pol.logprobs([prompt], [row.completion_ids]).sum())

    before = nll()
    for _ in range(3):
        stats = train_on_batch(pol, TrainBatch([row], n_prompts=1, kinds=parse_strategy("guide").kinds()))
    assert math.isfinite(stats["loss"]) and nll() < before  # a positive advantage raises its likelihood


def test_imitate_mixes_peer_successes_where_failed_and_own_where_solved(task):
    from mutualrl.algorithms.replay import PastFailure, Replay

    p0, p1, p2 = task.problems("train", 3)
    groups = [_group(p0, [0, 0, 0, 0]), _group(p1, [0, 1, 0, 0])]
    records = [_success(p0, p0.answer)]
    ctx = _ctx(task, groups, records, blocks={"imitate": {"weight": 0.5}})
    batch = _build("imitate", ctx)
    rescue = [r for r in batch.rows if r.kind == "imitate"]
    assert [r.completion_ids for r in rescue] == [_encode(None, p0.answer), groups[1].completion_ids[1]]
    assert all(r.weight == 0.5 for r in rescue)
    assert batch.metrics["imitate_rescue"] == 1 and batch.metrics["imitate_own"] == 1
    # replay: a peer success for a prompt failed at an earlier step joins, capped with the fresh ones
    ctx.gathered["imitate"] = Replay(failures=[PastFailure(p2, [7, 8], [_success(p2, p2.answer)], 0)])
    batch = _build("imitate", ctx)
    assert batch.metrics["imitate_rescue"] == 2 and batch.metrics["imitate_replayed"] == 1
    ctx.sharing_blocks = {"imitate": {"max_rows": 1}}
    assert _build("imitate", ctx).metrics["imitate_rescue"] == 1
    # a token budget: peers' rows only until the step trains that many tokens (here: one more row)
    grpo_and_own = sum(len(r.completion_ids) for r in _build("imitate", ctx).rows if r.kind != "imitate") + \
        len(groups[1].completion_ids[1])
    ctx.sharing_blocks = {"imitate": {"match_tokens": grpo_and_own + 1}}
    assert _build("imitate", ctx).metrics["imitate_rescue"] == 1
    ctx.sharing_blocks = {"imitate": {"match_tokens": 0}}
    assert _build("imitate", ctx).metrics["imitate_rescue"] == 2
    # peer rows may weigh differently from the own ones
    ctx.sharing_blocks = {"imitate": {"weight": 0.5, "peer_weight": 2.0}}
    weights = sorted(r.weight for r in _build("imitate", ctx).rows if r.kind == "imitate")
    assert weights == [0.5, 2.0, 2.0]
    # the control: the own rows alone
    control = _build("self_imitate", _ctx(task, groups, records))
    assert [r.kind for r in control.rows].count("self_imitate") == 1 and control.metrics.get("peer_rows", 0) == 0
    assert "cannot be combined" in check_strategy_name("imitate+sgt")


def test_self_imitate_with_a_ceiling_trains_at_most_its_budget_leaving_out_whole_groups(task):
    """``match_ceiling``: a control whose GRPO rows already pass its budget leaves out whole groups of
    them (in an order fixed by the prompts' ids: the same on every call) until it is within the
    budget; groups that do not train are passed over; without the flag, or under budget, nothing is
    left out. The own-success rows stay."""
    import hashlib

    from mutualrl.algorithms.sharing import trained_tokens

    probs = task.problems("train", 6)
    groups = [_group(p, [1, 0, 0, 1], prompt_len=3 + k, comp_len=3) for k, p in enumerate(probs[:5])]
    groups.append(_group(probs[5], [0, 0, 0, 0], comp_len=3))
    opts = GRPOOptions(dynamic_sampling="skip")
    free = _build("self_imitate", _ctx(task, groups, options=opts, blocks={"self_imitate": {"match_tokens": 30}}))
    full = trained_tokens(free, opts)
    assert full == 5 * 4 * 3 + 5 * 3  # five informative groups of four 3-token rows, one own success each
    blocks = {"self_imitate": {"match_tokens": 30, "match_ceiling": True}}
    capped = _build("self_imitate", _ctx(task, groups, options=opts, blocks=blocks))
    assert trained_tokens(capped, opts) <= 30 and capped.metrics["self_imitate_groups_left_out"] == 4
    assert [r.kind for r in capped.rows].count("self_imitate") == 5  # the own-success rows stay
    kept = {len(r.prompt_ids) for r in capped.rows if r.kind == "own"}
    last = max(range(5), key=lambda k: hashlib.sha256(probs[k].id.encode()).hexdigest())
    assert kept == {3 + last}  # the group last in the prompts' hash order is the one kept
    again = _build("self_imitate", _ctx(task, groups, options=opts, blocks=blocks))
    assert [r.prompt_ids for r in again.rows] == [r.prompt_ids for r in capped.rows]
    roomy = {"self_imitate": {"match_tokens": 1000, "match_ceiling": True}}
    assert _build("self_imitate", _ctx(task, groups, options=opts, blocks=roomy)).metrics[
        "self_imitate_groups_left_out"] == 0
    # without a budget (a study sets it per policy, the ceiling run-wide) nothing is left out
    unbounded = _build("self_imitate", _ctx(task, groups, options=opts, blocks={"self_imitate": {"match_ceiling": True}}))
    assert trained_tokens(unbounded, opts) == full and "self_imitate_groups_left_out" not in unbounded.metrics


def test_self_imitate_follows_its_schedule_step_by_step(task):
    """``match_schedule``: step ``t`` trains at most entry ``t`` (with the ceiling), an entry of 0 trains
    nothing at all (so the control takes no optimizer step where the matched arm took none), past the
    schedule's end ``match_tokens`` holds; a negative or non-integer entry is refused naming it."""
    from types import SimpleNamespace

    from mutualrl.algorithms.sharing import trained_tokens
    from mutualrl.algorithms.strategies.imitate import SelfImitateSettings, _gather_self_imitate
    from mutualrl.errors import ConfigError

    probs = task.problems("train", 5)
    groups = [_group(p, [1, 0, 0, 1], comp_len=3) for p in probs]
    opts = GRPOOptions(dynamic_sampling="skip")
    block = {"match_tokens": 1000, "match_ceiling": True, "match_schedule": [0, 30]}
    settings = SelfImitateSettings(**block)

    def at(step):
        ctx = _ctx(task, groups, options=opts, blocks={"self_imitate": block})
        ctx.gathered["self_imitate"] = _gather_self_imitate(SimpleNamespace(step=step), settings)
        return _build("self_imitate", ctx)

    assert at(0).rows == [] and at(0).metrics["self_imitate_rows_left_out"] == 5 * 4
    assert 0 < trained_tokens(at(1), opts) <= 30
    assert trained_tokens(at(2), opts) == 5 * 4 * 3 + 5 * 3  # past the end: match_tokens, 1000
    for bad in ([-1], [1.5], [True]):
        with pytest.raises(ConfigError, match=r"match_schedule\[0\]"):
            SelfImitateSettings(match_schedule=bad)
