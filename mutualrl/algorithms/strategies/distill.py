"""``distill``: a dense signal from the peer that knows. Each policy scores its peers' samples with
its own model; a learner adds, to every token of its own sample, the peer's verdict on it:
``log pi_peer(chunk) - log pi_self(chunk)`` over the THL chunk the token belongs to, clipped, times a
weight that grows with how much better that peer is on the sample's task type.

**The estimator.** On-policy distillation minimises the reverse KL ``KL(pi_self || pi_peer)`` on the
learner's own samples; its policy gradient, with no discounting (every token credited with its own
term, as on-policy distillation does), is the policy gradient of the per-token advantage
``log pi_peer(y_t) - log pi_self(y_t)``. Across tokenizers single tokens do not correspond, so the
unit here is the THL chunk (:func:`mutualrl.thl.scores.score_chunks`): the smallest span both
tokenizers cover in whole tokens. Every token of chunk ``c`` gets ``a_c = clip(log pi_peer(c) -
log pi_self(c), -clip, clip)``, so a chunk contributes ``a_c grad log pi_self(c)``: the chunk-level
reverse-KL advantage, tokenization-invariant (a number split into digits by one tokenizer and kept
whole by the other is one chunk on both sides: the failure NeMo-RL's X-Token reports for
token-level cross-tokenizer scores cannot arise). ``log pi_self(c)`` is the sampler's behavior
log-prob sum, what the sample was drawn with. The signal joins the GRPO outcome advantage of the
learner's own rows (:attr:`~mutualrl.algorithms.batch.TrainRow.token_advantages`): one forward and
backward serves both, under the same ratio clipping.

**Mutual and gated.** Every policy scores every peer's samples (the ``serve`` phase between the
rollouts and the updates, priced by MWRA); each learner decides whom it listens to. Per task type
and peer it re-verifies, with its own verifier, the whole groups (every sample index of a group
present once) that the peer and it published over the last ``gate_window`` steps on the same
prompts: the peer teaches that type only when it has at least ``min_successes`` verified successes
there and a success rate above the learner's by more than ``min_gap``; its weight is
``weight * min(1, gap / full_gap)``. The tallies are summed over a policy's ranks, so every rank
opens the same gates. A peer whose verified record is weaker never teaches; its claimed rewards count
for nothing, and publishing only its successes leaves those groups out. A peer that publishes
correct answers it did not produce itself (copied from the exchange) can open the gate; what its
scores can then do is bounded: no score moves a token's advantage by more than ``weight * clip``. A
score whose chunks differ from the learner's own chunking of its sample is refused.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mutualrl.algorithms.context import PeerView, StepSource
from mutualrl.algorithms.registry import OWN_GROUPS
from mutualrl.algorithms.sharing import ShareContext, TrainBatch, own_rows_by_prompt, register_strategy
from mutualrl.config.schema import bounded
from mutualrl.experience import PeerScore, Rollout
from mutualrl.tasks.base import SUCCESS_THRESHOLD, Problem
from mutualrl.thl.scores import score_chunks

SCORE = "peer_score"
ROLLOUT = "rollout"


@dataclass
class DistillSettings:
    """``sharing.distill``: dense peer scores of the learner's own samples."""

    weight: float = bounded(0.5, ge=0)
    """Scale of the per-chunk signal from a peer whose success-rate gap is ``full_gap`` or more."""
    clip: float = bounded(1.0, gt=0)
    """Bound of a chunk's log-prob difference (nats): no score moves a token's advantage by more than
    ``weight * clip``."""
    gate_window: int = bounded(8, ge=1)
    """Steps of published rollouts (this one included) the gate re-verifies."""
    min_successes: int = bounded(2, ge=1)
    """Verified successes of a task type a peer needs in the window before it may teach that type."""
    min_gap: float = bounded(0.0, ge=0)
    """The peer's success rate must exceed the learner's by more than this."""
    full_gap: float = bounded(0.25, gt=0)
    """The gap at which a peer teaches with the full ``weight`` (linear below it)."""
    max_scored: int = bounded(0, ge=0)
    """Peers' samples a policy scores per step, at most (0: every one)."""


# ----------------------------------------------------------------------------- the scorer's side
def _serve(src: StepSource, s: DistillSettings) -> tuple[list[PeerScore], dict[str, float]]:
    """Score the peers' samples of this step with this policy's model, chunk by chunk."""
    probs = src.problems(src.step)
    if not probs or src.score_texts is None or src.me is None:
        return [], {}
    rows = [r for r in src.query([p.id for p in probs], kinds=[ROLLOUT], exclude_source=src.learner,
                                 min_version=src.step)
            if r.version == src.step and r.source_policy in src.peers
            and src.peers[r.source_policy].tokenizer_id == r.source_tokenizer]
    rows.sort(key=lambda r: (r.source_policy, r.prompt_id, r.sample_index))
    if s.max_scored:
        rows = rows[:s.max_scored]
    eos = getattr(src.me.tokenizer, "eos_token_id", None)
    jobs = []
    for r in rows:
        student = src.peers[r.source_policy]
        ch = score_chunks(r.completion, r.token_ids, student.tokenizer, student.format_prompt(r.prompt),
                          student.stop_ids, src.me.tokenizer, src.me.format_prompt(r.prompt))
        if ch is None or (ch.stopped and eos is None):
            continue
        jobs.append((r, ch, src.encode_prompt(r.prompt), list(ch.scorer_ids) + ([int(eos)] if ch.stopped else [])))
    lps = src.score_texts([j[2] for j in jobs], [j[3] for j in jobs]) if jobs else []
    out = [PeerScore(rollout_id=r.record_id, prompt_id=r.prompt_id, version=src.step, sample_index=r.sample_index,
                     chunk_ends=ch.char_ends, chunk_logprobs=tuple(ch.sums(lp, "scorer")), stopped=int(ch.stopped),
                     stop_logprob=float(lp[-1]) if ch.stopped else 0.0, source_policy=src.learner,
                     source_tokenizer=src.me.tokenizer_id)
           for (r, ch, _, _), lp in zip(jobs, lps, strict=True)]
    tokens = sum(len(p) + len(c) for _, _, p, c in jobs)
    return out, {"distill_scored": float(len(out)), "distill_unscorable": float(len(rows) - len(out)),
                 "scored_tokens": float(tokens)}


# ----------------------------------------------------------------------------- the learner's side
@dataclass
class DistillInputs:
    """What the learner gathers for ``distill`` at a step."""

    learner: str
    me: PeerView
    teachers: Mapping[str, PeerView]
    scores: dict[str, list[PeerScore]] = field(default_factory=dict)
    """The peers' scores of this step's own samples, by the scored rollout's record id."""
    evidence: list[Rollout] = field(default_factory=list)
    """Every rollout of the gate's window (the learner's and its peers'), for re-verification."""
    problems: dict[str, Problem] = field(default_factory=dict)
    """The window's prompts by id."""
    task_types: tuple[str, ...] = ()
    """The task's problem types (the gate's keys, the same on every rank)."""
    verdicts: dict[str, float] = field(default_factory=dict)
    """The learner's verdicts of rollouts it already re-verified, by record id (a cache across steps)."""


def _gather(src: StepSource, s: DistillSettings) -> DistillInputs | None:
    """The peers' scores of this step's own samples and the gate's evidence."""
    if src.me is None:
        return None
    step = src.step
    first = max(0, step - s.gate_window + 1)
    window = {p.id: p for st in range(first, step + 1) for p in src.problems(st)}
    if not window:
        return None
    own_ids = [p.id for p in src.problems(step)]
    scores: dict[str, list[PeerScore]] = defaultdict(list)
    for x in src.query(own_ids, kinds=[SCORE], exclude_source=src.learner, min_version=step):
        if x.version == step and x.source_policy in src.peers:
            scores[x.rollout_id].append(x)
    evidence = [r for r in src.query(list(window), kinds=[ROLLOUT], min_version=first)
                if r.version <= step and (r.source_policy == src.learner or r.source_policy in src.peers)]
    return DistillInputs(src.learner, src.me, dict(src.peers), dict(scores), evidence, window, src.task_types,
                         src.memo.setdefault("distill_verdicts", {}))


def complete_groups(rollouts: Sequence[Rollout]) -> dict[tuple[str, str, int], list[Rollout]]:
    """The published groups that are whole: per (policy, prompt, version), sample indices 0..n-1 each
    exactly once, n >= 2. A peer that publishes only some of a group's samples (its successes, say)
    has that group left out of the gate's evidence."""
    by: dict[tuple[str, str, int], dict[int, list[Rollout]]] = defaultdict(lambda: defaultdict(list))
    for r in rollouts:
        by[(r.source_policy, r.prompt_id, r.version)][r.sample_index].append(r)
    return {k: [g[i][0] for i in range(len(g))] for k, g in by.items()
            if len(g) >= 2 and set(g) == set(range(len(g))) and all(len(v) == 1 for v in g.values())}


def _verdicts(ctx: ShareContext, inp: DistillInputs, rollouts: list[Rollout]) -> list[bool]:
    """Whether the learner's own verifier accepts each rollout (cached by record id across steps)."""
    todo = [r for r in rollouts if r.record_id not in inp.verdicts]
    if todo:
        _, scores = ctx.score([inp.problems[r.prompt_id] for r in todo], [r.completion for r in todo])
        if len(inp.verdicts) > 500_000:  # a long run: keep the cache bounded
            inp.verdicts.clear()
        inp.verdicts.update((r.record_id, float(v)) for r, v in zip(todo, scores, strict=True))
    return [inp.verdicts[r.record_id] >= SUCCESS_THRESHOLD for r in rollouts]


def _gate_tally(ctx: ShareContext, inp: DistillInputs) -> tuple[list[tuple[str, str]], list[float]]:
    """Per (peer, type): the peer's and the learner's verified successes and samples over the prompts
    both have whole groups of in the window (paired), summed over the policy's ranks."""
    groups = {k: g for k, g in complete_groups(inp.evidence).items() if k[1] in inp.problems}
    flat = [r for g in groups.values() for r in g]
    ok = dict(zip((r.record_id for r in flat), _verdicts(ctx, inp, flat), strict=True))
    prompts: dict[str, set[str]] = defaultdict(set)
    for name, pid, _ in groups:
        prompts[name].add(pid)
    types = inp.task_types or tuple(sorted({p.source for p in inp.problems.values()}))
    keys = [(name, kind) for name in sorted(inp.teachers) for kind in types]
    index = {k: 4 * i for i, k in enumerate(keys)}
    tally = [0.0] * (4 * len(keys))
    for (name, pid, _), g in groups.items():
        kind = inp.problems[pid].source
        for peer in ([name] if name != inp.learner else sorted(inp.teachers)):
            if (peer, kind) not in index or pid not in prompts[inp.learner] or pid not in prompts[peer]:
                continue  # paired prompts only: both answered it in whole groups
            at = index[(peer, kind)] + (2 if name == inp.learner else 0)
            tally[at] += sum(ok[r.record_id] for r in g)
            tally[at + 1] += len(g)
    if ctx.sum_over_ranks is not None:  # every rank judges on the whole step's evidence, and agrees
        tally = ctx.sum_over_ranks(tally)
    return keys, tally


def gate_weights(ctx: ShareContext, inp: DistillInputs, s: DistillSettings) -> dict[tuple[str, str], float]:
    """Per (peer, task type), the weight the peer teaches that type with (absent: the gate is shut):
    from the whole groups both published over the window on the same prompts, every sample
    re-verified by the learner's own verifier."""
    keys, tally = _gate_tally(ctx, inp)
    out: dict[tuple[str, str], float] = {}
    for i, key in enumerate(keys):
        wins, n, own_wins, own_n = tally[4 * i:4 * i + 4]
        if wins < s.min_successes or not n or not own_n:
            continue
        gap = wins / n - own_wins / own_n
        if gap > s.min_gap and gap > 0:
            out[key] = s.weight * min(1.0, gap / s.full_gap)
    return out


def chunk_signal(text: str, sampled: Sequence[int], behavior: Sequence[float], score: PeerScore,
                 teacher: PeerView, me: PeerView, question: str, clip: float) -> list[float] | None:
    """Per token of the learner's sample, the clipped chunk-level log-prob difference
    ``log pi_peer(chunk) - log pi_self(chunk)`` of ``score``; None when the score's chunks are not the
    learner's own chunking of the sample (a bug or a hostile peer) or the tokenizers do not match."""
    if score.source_tokenizer != teacher.tokenizer_id or len(behavior) != len(sampled):
        return None
    ch = score_chunks(text, sampled, me.tokenizer, me.format_prompt(question), me.stop_ids, teacher.tokenizer,
                      teacher.format_prompt(question))
    if ch is None or ch.char_ends != tuple(score.chunk_ends) or bool(score.stopped) != ch.stopped:
        return None
    own = ch.sums(behavior, "student")
    out = [0.0] * len(sampled)
    carry, last = 0.0, None
    for k in range(ch.n):
        a, b = ch.student_bounds[k], ch.student_bounds[k + 1]
        d = score.chunk_logprobs[k] - own[k] + carry
        if a == b:  # text the learner has no token of: its difference joins the next chunk
            carry = d
            continue
        carry, last = 0.0, (a, b, d)
        out[a:b] = [max(-clip, min(clip, d))] * (b - a)
    if carry and last is not None:
        a, b, d = last
        out[a:b] = [max(-clip, min(clip, d + carry))] * (b - a)
    if ch.stopped:
        out[-1] = max(-clip, min(clip, score.stop_logprob - behavior[-1]))
    return out


@register_strategy("distill", settings=DistillSettings, gathers=(SCORE, ROLLOUT), needs=(OWN_GROUPS,),
                   gather=_gather, serve=_serve)
def distill(ctx: ShareContext, batch: TrainBatch, s: DistillSettings) -> None:
    """Dense peer scores: a better peer's chunk-level log-probs of the learner's own samples."""
    inp: DistillInputs | None = ctx.gathered.get("distill")
    tally: Counter[str] = Counter()
    signal: list[float] = []
    gates = gate_weights(ctx, inp, s) if inp is not None else {}
    for g, rows in zip(ctx.groups, own_rows_by_prompt(batch, ctx.groups), strict=True):
        teachers = sorted(((w, name) for (name, kind), w in gates.items() if kind == g.problem.source), reverse=True)
        if inp is None or not teachers:
            continue
        for j, row in enumerate(rows):
            by = {x.source_policy: x for x in inp.scores.get(g.record_ids[j] if j < len(g.record_ids) else "", [])}
            for w, name in teachers:  # the best open teacher whose score checks out
                if name not in by:
                    continue
                adv = chunk_signal(g.texts[j], row.completion_ids, row.old_logprobs or [], by[name],
                                   inp.teachers[name], inp.me, g.problem.question, s.clip)
                if adv is None:
                    tally["refused"] += 1
                    continue
                row.token_advantages = [w * a for a in adv]
                signal += row.token_advantages
                batch.peer_rows[name] += 1
                tally["rows"] += 1
                break
    batch.metrics["distill_gate_open"] = float(len(gates))
    batch.metrics["distill_rows"] = float(tally["rows"])
    batch.metrics["distill_refused"] = float(tally["refused"])
    batch.metrics["distill_signal_mean"] = sum(signal) / len(signal) if signal else 0.0
    batch.metrics["distill_signal_abs_mean"] = sum(map(abs, signal)) / len(signal) if signal else 0.0
