"""``distill``: peer scores as typed experience, the chunk-level reverse-KL signal across tokenizers,
the gate judged on outcomes the learner verifies itself, and the clip against hostile scores."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mutualrl.algorithms.context import OwnGroup, PeerRows, PeerView, ShareContext, StepSource
from mutualrl.algorithms.sharing import build_batch, serve_peers
from mutualrl.algorithms.strategies.distill import DistillInputs, DistillSettings, chunk_signal, gate_weights
from mutualrl.config import GRPOOptions
from mutualrl.experience import ExperienceLimits, InvalidExperience, PeerScore, Rollout, parse, validate
from mutualrl.tasks.base import Problem

TEXT = "12+34=46"
EOS = 1


def _toy(pattern: str, tokens: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer that cuts text with ``pattern`` and writes it back as it was."""
    vocab = {"[UNK]": 0, "<eos>": EOS, **{t: i + 2 for i, t in enumerate(tokens)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")


GROUPS = _toy(r"\d+|.", ["12", "+", "34", "=", "46", "?"])  # numbers whole (the student)
CHARS = _toy(".", list("0123456789+=?"))  # every digit its own token (the teacher)
STUDENT = PeerView("student", GROUPS, "tok-groups", frozenset({EOS}), "{question}", None)
TEACHER = PeerView("teacher", CHARS, "tok-chars", frozenset({EOS}), "{question}", None)
SAMPLED = GROUPS(TEXT, add_special_tokens=False)["input_ids"] + [EOS]  # 12 + 34 = 46 <eos>
BEHAVIOR = [-0.5, -0.1, -2.0, -0.2, -0.3, -0.05]
TEACHER_LPS = [-0.1, -0.2, -0.05, -0.1, -0.1, -0.1, -4.0, -4.0, -0.2]  # 1 2 + 3 4 = 4 6 <eos>
PROBLEM = Problem("p0", "", "46", "add")


def _student_rollout() -> Rollout:
    return Rollout(PROBLEM.id, PROBLEM.question, TEXT, "student", "tok-groups", SAMPLED, BEHAVIOR, 1.0, 3, 0)


def _teacher_score(**override) -> PeerScore:
    """The teacher's score of the student's sample, made by the teacher's own serve hook."""
    roll = _student_rollout()
    src = StepSource(3, "teacher", frozenset({"student"}), lambda step: [PROBLEM] if step == 3 else [],
                     lambda ids, **kw: [roll], lambda q: [], {"student": STUDENT}, TEACHER,
                     lambda prompts, completions: [TEACHER_LPS[:len(c)] for c in completions], 1000)
    records, metrics = serve_peers("distill", src, {"distill": override})
    assert len(records) == 1 and metrics["distill_scored"] == 1
    return records[0]


def test_the_signal_is_the_chunk_level_reverse_kl_computed_by_hand():
    """Numbers are one token for the student, one per digit for the teacher: the chunks are the
    student's tokens, the teacher's score of a chunk is the sum of its digits' log-probs, and each
    token gets clip(log pi_teacher(chunk) - log pi_student(chunk))."""
    score = _teacher_score()
    assert score.chunk_ends == (2, 3, 5, 6, 8) and score.stopped == 1 and score.rollout_id == _student_rollout().record_id
    assert score.chunk_logprobs == pytest.approx((-0.3, -0.05, -0.2, -0.1, -8.0)) and score.stop_logprob == -0.2
    validate(parse(score.to_json()))  # a well-formed record of its kind
    signal = chunk_signal(TEXT, SAMPLED, BEHAVIOR, score, TEACHER, STUDENT, PROBLEM.question, clip=1.0)
    by_hand = [-0.3 - -0.5, -0.05 - -0.1, -0.2 - -2.0, -0.1 - -0.2, -8.0 - -0.3, -0.2 - -0.05]
    assert signal == pytest.approx([max(-1.0, min(1.0, d)) for d in by_hand])
    assert signal[2] == 1.0 and signal[4] == -1.0  # the two clipped chunks


def test_a_score_whose_chunks_are_not_the_learners_is_refused():
    score = _teacher_score()
    for bad in ({"chunk_ends": (2, 3, 5, 8), "chunk_logprobs": (-0.3, -0.05, -0.2, -8.1)},  # one chunk fewer
                {"chunk_ends": (1, 3, 5, 6, 8)}, {"stopped": 0, "stop_logprob": 0.0},
                {"source_tokenizer": "tok-other"}):
        forged = PeerScore(**{**{f: getattr(score, f) for f in PeerScore.FIELD_NAMES}, **bad})
        assert chunk_signal(TEXT, SAMPLED, BEHAVIOR, forged, TEACHER, STUDENT, "", clip=1.0) is None


@pytest.mark.parametrize("field,value,reason", [
    ("chunk_logprobs", [-0.3, float("nan"), -0.2, -0.1, -8.0], "non_finite"),
    ("chunk_logprobs", [-0.3, 0.5, -0.2, -0.1, -8.0], "logprob_range"),
    ("stop_logprob", float("inf"), "non_finite"),
    ("chunk_logprobs", [-0.3, -0.05], "length_mismatch"),
    ("chunk_ends", [2, 2, 5, 6, 8], "inconsistent"),
    ("chunk_ends", [0, 3, 5, 6, 8], "inconsistent"),
    ("stopped", 2, "wrong_type"),
])
def test_hostile_score_rows_are_refused_with_a_reason(field, value, reason):
    d = _teacher_score().to_dict()
    d[field] = value  # the record id no longer matches either: the value is refused first
    with pytest.raises(InvalidExperience) as exc:
        parse(d, ExperienceLimits())
    assert exc.value.reason == reason


def test_an_oversize_score_is_refused():
    score = _teacher_score()
    n = 40
    big = PeerScore(rollout_id=score.rollout_id, prompt_id=score.prompt_id, version=3, sample_index=0,
                    chunk_ends=tuple(range(1, n + 1)), chunk_logprobs=(-0.1,) * n, stopped=0, stop_logprob=0.0,
                    source_policy="teacher", source_tokenizer="tok-chars")
    with pytest.raises(InvalidExperience) as exc:
        parse(big.to_json(), ExperienceLimits(max_tokens=32))
    assert exc.value.reason == "too_large"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["chunk_ends", "chunk_logprobs", "stopped", "stop_logprob", "rollout_id"]),
       value=st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=5),
                       st.lists(st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True)), max_size=8)))
def test_parse_refuses_any_mangled_score_with_a_reason(field, value):
    d = _teacher_score().to_dict()
    d[field] = value
    try:
        rec = parse(d)
    except InvalidExperience:
        return
    assert all(math.isfinite(v) and v <= 1e-3 for v in rec.chunk_logprobs)  # whatever is accepted is sane


# ----------------------------------------------------------------------------- the gate
def _evidence(name: str, wins: int, n: int, kind: str = "add", group: int = 2) -> list[Rollout]:
    """``n`` samples of ``name`` in whole groups of ``group`` on prompts ``<kind>0``, ``<kind>1``, ...:
    the first ``wins`` of them right."""
    return [Rollout(f"{kind}{i // group}", "", "46" if i < wins else "0", name, "t", [2], [-0.1], 0.0, 1,
                    i % group) for i in range(n)]


def _ctx(groups=()) -> ShareContext:
    """A learner whose verifier accepts "46" only (it re-verifies every claim)."""
    def score(problems, completions):
        ok = [1.0 if c == "46" else 0.0 for c in completions]
        return ok, ok
    return ShareContext(list(groups), PeerRows(), GRPOOptions(dynamic_sampling="off"), score, lambda ids, t: None)


def _inputs(evidence) -> DistillInputs:
    probs = {r.prompt_id: Problem(r.prompt_id, "", "46", r.prompt_id.rstrip("0123456789").replace("_other", ""))
             for r in evidence}
    return DistillInputs("student", STUDENT, {"teacher": TEACHER}, {}, evidence, probs)


def test_the_gate_opens_for_a_better_peer_with_a_weight_that_grows_with_the_gap():
    s = DistillSettings(weight=0.5, full_gap=0.5, min_successes=2)
    small = gate_weights(_ctx(), _inputs(_evidence("student", 2, 8) + _evidence("teacher", 4, 8)), s)
    large = gate_weights(_ctx(), _inputs(_evidence("student", 0, 8) + _evidence("teacher", 8, 8)), s)
    assert small == {("teacher", "add"): pytest.approx(0.5 * 0.25 / 0.5)} and large == {("teacher", "add"): 0.5}


def test_the_gate_stays_shut_for_a_weaker_peer_and_for_claims_that_fail_reverification():
    s = DistillSettings(min_successes=2)
    weaker = _evidence("student", 6, 8) + _evidence("teacher", 3, 8)
    assert gate_weights(_ctx(), _inputs(weaker), s) == {}
    # a hostile peer claims a reward of 1 on every sample, but its texts are wrong: the learner's
    # verifier rejects every one, so the peer has no success to open the gate with
    liar = [Rollout(f"add{i // 2}", "", "999", "teacher", "t", [2], [-0.1], 1.0, 1, i % 2) for i in range(8)]
    assert gate_weights(_ctx(), _inputs(_evidence("student", 0, 8) + liar), s) == {}
    # per task type: a peer better at "add" does not teach "sub"
    mixed = _evidence("student", 0, 8) + _evidence("teacher", 8, 8) + _evidence("student", 0, 8, "sub") + \
        _evidence("teacher", 0, 8, "sub")
    assert set(gate_weights(_ctx(), _inputs(mixed), s)) == {("teacher", "add")}


def test_a_peer_that_publishes_only_its_successes_does_not_open_the_gate():
    """Groups count whole: a peer that leaves its failed samples out of the exchange (sample 1 of
    every group missing, or a success published twice) has no evidence, however right the rest is;
    and only prompts both policies answered count."""
    s = DistillSettings(min_successes=2)
    own = _evidence("student", 0, 8)
    selective = [r for r in _evidence("teacher", 8, 8) if r.sample_index == 0]
    assert gate_weights(_ctx(), _inputs(own + selective), s) == {}
    # a second record at an index breaks that group alone: the three other whole groups still count
    clash = _evidence("teacher", 8, 8) + [Rollout("add0", "", "46 ", "teacher", "t", [2], [-0.1], 0.0, 1, 0)]
    from mutualrl.algorithms.strategies.distill import complete_groups
    assert sorted(k[1] for k in complete_groups(clash)) == ["add1", "add2", "add3"]
    assert gate_weights(_ctx(), _inputs(own + clash), s) == {("teacher", "add"): s.weight}
    elsewhere = _evidence("teacher", 8, 8, kind="add_other")  # right answers, but on prompts the learner has not seen
    assert gate_weights(_ctx(), _inputs(own + elsewhere), s) == {}


# ----------------------------------------------------------------------------- the step and the clip
def _group() -> OwnGroup:
    roll = _student_rollout()
    return OwnGroup(PROBLEM, [5], [list(SAMPLED)], [list(BEHAVIOR)], [0.0], [0.0], [TEXT], [roll.record_id])


def _distill_batch(score: PeerScore, **settings):
    g = _group()
    inp = DistillInputs("student", STUDENT, {"teacher": TEACHER}, {score.rollout_id: [score]},
                        _evidence("student", 0, 4) + _evidence("teacher", 4, 4), {})
    inp.problems = {r.prompt_id: Problem(r.prompt_id, "", "46", "add") for r in inp.evidence}
    ctx = _ctx([g])
    ctx.gathered["distill"] = inp
    return build_batch("distill", ctx, {"distill": settings})


def test_a_hostile_score_moves_the_learner_no_more_than_the_clip_allows():
    """Scores past the clip in either direction give exactly the update of scores at the clip: a
    hostile peer that got through the gate cannot push any token's advantage beyond weight x clip."""
    honest = _teacher_score()
    fields = {f: getattr(honest, f) for f in PeerScore.FIELD_NAMES}
    # the student's chunks hold -0.5, -0.1, -2.0, -0.2, -0.3 and its stop -0.05: differences of exactly
    # +clip, -clip, +clip, -clip, -clip, -clip, then as far past them as a log-prob can go
    at_clip = PeerScore(**{**fields, "chunk_logprobs": (0.0, -0.6, -1.5, -0.7, -0.8), "stop_logprob": -0.55})
    extreme = PeerScore(**{**fields, "chunk_logprobs": (0.0, -500.0, 0.0, -500.0, -500.0), "stop_logprob": -900.0})
    w, clip = 0.3, 0.5
    a = _distill_batch(at_clip, weight=w, clip=clip, full_gap=0.25)
    b = _distill_batch(extreme, weight=w, clip=clip, full_gap=0.25)
    ta, tb = a.rows[0].token_advantages, b.rows[0].token_advantages
    assert a.metrics["distill_rows"] == b.metrics["distill_rows"] == 1
    assert max(abs(x) for x in ta + tb) <= w * clip + 1e-12
    assert [abs(x) for x in tb] == pytest.approx([w * clip] * len(tb))
    assert ta == pytest.approx(tb) and [x > 0 for x in ta] == [True, False, True, False, False, False]


def test_the_dense_advantage_trains_through_the_surrogate(tiny_models):
    """A positive token-level advantage on an own row raises that row's likelihood; the same row
    with no advantage at all does not train."""
    from mutualrl.algorithms.batch import TrainBatch, TrainRow
    from mutualrl.algorithms.update import train_on_batch
    from mutualrl.rollout.policy import Policy

    torch.manual_seed(0)
    pol = Policy("a", str(tiny_models["tiny-llama"]), GRPOOptions(learning_rate=1e-2, num_generations=1))
    prompt, completion = [3, 4, 5], [6, 7, 8]
    with torch.no_grad():
        old = pol.logprobs([prompt], [completion])[0].tolist()
    row = TrainRow(prompt, completion, 0.0, old, token_advantages=[1.0, 1.0, 1.0])
    before = sum(old)
    stats = train_on_batch(pol, TrainBatch([row], n_prompts=1))
    with torch.no_grad():
        after = float(pol.logprobs([prompt], [completion]).sum())
    assert stats["optimizer_steps"] == 1 and after > before


@pytest.mark.parametrize("sync", ["sync", "async"])
def test_distill_is_mutual_on_the_zoo_specialists(tiny_config, sync):
    """gpt2-add knows addition, llama-sub subtraction: each scores the other's samples (the serve
    phase), each opens its gate to the other on the other's skill only, and both train on the
    signal; every row reports FLOPs split into sampling, scoring and update."""
    from mutualrl.run.trainer import MutualTrainer

    cfg = dict(tiny_config, steps=2, eval_every=100, checkpoint_every=100, scheduler="sequential", threads=1,
               sync=sync, policies=[{"name": "g", "model": "zoo:gpt2-add"}, {"name": "l", "model": "zoo:llama-sub"}],
               task={"preset": "zoo", "test_size": 20, "train_size": 200},
               grpo={"num_generations": 4, "max_completion_length": 6},
               sharing={"strategy": "imitate+distill", "distill": {"min_successes": 1}})
    tr = MutualTrainer(cfg, None, progress=False)
    summary = tr.train()
    rows = [r for r in tr.history if r.get("event") is None]
    assert len(rows) == 4
    for name in ("g", "l"):  # the run's compute per policy, by phase, what a control is matched on
        mine = summary["policies"][name]
        assert mine["flops_scoring"] == sum(r["flops_scoring"] for r in rows if r["policy"] == name) > 0
        assert mine["train_tokens"] > 0 and mine["flops_update"] > 0
    for r in rows:
        assert r["distill_scored"] > 0 and r["flops_scoring"] > 0
        assert r["flops_sampling"] > 0 and r["flops_update"] > 0
    taught = {r["policy"] for r in rows if r["distill_rows"] > 0}
    assert taught == {"g", "l"}, [(r["policy"], r["distill_gate_open"], r["distill_rows"]) for r in rows]


def test_a_non_canonical_sample_is_chunked_by_its_own_pieces():
    """The student wrote 12 as "1" + "2" (not its tokenizer's own "12"): its chunks come from its
    pieces' spans, not one chunk over the whole text, and both sides still agree on them."""
    from mutualrl.thl.scores import score_chunks

    pieces = _toy(r"\d+|.", ["1", "2", "12", "+", "34", "=", "46"])
    sampled = [pieces.convert_tokens_to_ids(x) for x in ("1", "2", "+", "34", "=", "46")] + [EOS]
    ch = score_chunks(TEXT, sampled, pieces, "", {EOS}, CHARS, "")
    assert not ch.canonical and ch.char_ends == (1, 2, 3, 5, 6, 8) and ch.student_bounds == (0, 1, 2, 3, 4, 5, 6)
    assert score_chunks(TEXT, sampled, pieces, "", {EOS}, CHARS, "") == ch  # deterministic: the check agrees


def test_the_worker_queries_only_what_ctx_peers_needs_and_distill_gathers_the_rest():
    """distill fetches its scores and the gate's window itself (its ``gather`` hook): the worker does
    not query those kinds again for ``ctx.peers``, yet distill still counts as reading the peers
    (two policies needed); a chain queries what its other steps read."""
    from mutualrl.algorithms.registry import parse_strategy, register_strategy

    d = parse_strategy("distill")
    assert d.queries == frozenset() and d.reads == {"peer_score", "rollout"}
    assert parse_strategy("imitate+distill").queries == {"verified_success"}
    with pytest.raises(ValueError, match="without a gather hook"):
        register_strategy("gathers_nothing", gathers=("rollout",))(lambda ctx, batch: None)
