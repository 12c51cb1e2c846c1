"""From a :class:`TrainBatch` to optimizer steps: every row kind trained by the loss term its step
declared, summed, in the optimizer step the kind asks for.

The update knows no strategy: a batch carries its row kinds (:attr:`TrainBatch.kinds`), each
bound to the registered loss term that trains it (:mod:`mutualrl.algorithms.losses`), its
per-token weights and its optimizer phase. The policy's own phase takes ``num_iterations`` steps
on the kinds that join it (the own rows, and whatever a step adds to the GRPO loss); a kind with
a learning rate of its own trains afterwards in one AdamW step of its own (its phase). Within a
phase one forward pass serves every row (they share prompts), each kind's term is reduced over
counts of the whole batch (:class:`~mutualrl.algorithms.losses.BatchCounts`), and the terms are
summed.

A policy trained by several data-parallel ranks (:class:`~mutualrl.run.distributed.RankGroup`) passes
its group as ``ranks``: the counts are summed over the ranks, every rank takes every phase that
has rows on any rank (a rank without rows contributes a zero gradient), and the gradients are
summed before clipping, so each rank takes the optimizer step a single worker takes on the whole
batch.

The PPO reference of on-policy rows is the trainer's own forward before the first optimizer step
(as TRL does), so the ratio is exactly 1 at the first iteration whatever the sampler did
(``top_p``, another engine, float rounding). The sampler's log-probs serve two purposes only: the
logged sampler/trainer mismatch and, when asked for, the truncated importance correction of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from mutualrl.algorithms.batch import BatchCounts, TrainBatch, TrainRow
from mutualrl.algorithms.losses import TermInputs, reduce
from mutualrl.algorithms.micro_batch import MicroBatch, StatMerger, split_micro_batches
from mutualrl.algorithms.registry import BASE, OWN, POLICY_PHASE, BoundKind, parse_strategy
from mutualrl.allocation.memory import SavedBytes
from mutualrl.config import GRPOOptions
from mutualrl.rollout.policy import Policy
from mutualrl.rollout.token_tensors import pack_right, right_mask
from mutualrl.run.distributed import RankGroup
from mutualrl.run.fsdp import full_value


def mismatch_stats(logp: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's behavior log-probs are from the trainer's recompute, on real tokens."""
    d = (logp - behavior).abs()[mask]
    if d.numel() == 0:
        return {}
    ratio = torch.exp((logp - behavior)[mask])
    return {"logprob_mismatch_max": float(d.max()), "logprob_mismatch_mean": float(d.mean()),
            "logprob_ratio_outside_frac": float(((ratio < 0.9) | (ratio > 1.1)).float().mean())}


def bound_kinds(batch: TrainBatch) -> dict[str, BoundKind]:
    """The batch's row kinds; for a batch built by hand (no kinds), the base step's (own rows only)."""
    return batch.kinds or parse_strategy(BASE).kinds()


def batch_counts(batch: TrainBatch, num_generations: int = 1) -> BatchCounts:
    """The reductions' denominators over ``batch``: its policy-gradient rows and their tokens, and its
    prompts (``batch.n_prompts``, else the rows over ``num_generations``; a data-parallel rank sums
    these over the ranks of its policy)."""
    kinds = bound_kinds(batch)
    pg = [r for r in batch.rows if kinds[r.kind].term.reduction == "policy_gradient"]
    return BatchCounts(len(pg), sum(len(r.completion_ids) for r in pg),
                       batch.n_prompts or max(1, len(pg) // max(1, num_generations)))


def _stat_key(kind: str, key: str) -> str:
    """The own rows' statistics keep their plain names (``clip_frac``); other kinds' carry the kind
    (``<kind>_nll``)."""
    return key if kind == OWN else f"{kind}_{key}"


class _Part:
    """The rows of one kind within a phase, as tensors (the slice of the phase's forward pass)."""

    def __init__(self, kind: BoundKind, rows: list[TrainRow], start: int, width: int, device: torch.device) -> None:
        self.kind, self.rows, self.sl = kind, rows, slice(start, start + len(rows))
        self.mask = right_mask([len(r.completion_ids) for r in rows], width).to(device)
        self.advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device)
        self.row_weight = torch.tensor([r.weight for r in rows], dtype=torch.float32, device=device)
        dense = any(r.token_advantages for r in rows)
        self.token_advantages = pack_right([r.token_advantages or [0.0] * len(r.completion_ids) for r in rows],
                                           width).to(device) if dense else None
        on_policy = all(r.old_logprobs is not None for r in rows)
        self.behavior = pack_right([r.old_logprobs for r in rows], width).to(device) if on_policy else None  # type: ignore[misc]
        self.old: torch.Tensor | None = None
        self.ref: torch.Tensor | None = None
        self.correction: torch.Tensor | None = None


def _goes_on(ranks: RankGroup | None, trainable: bool) -> bool:
    """Whether an optimizer step goes ahead: this rank has a loss to train or, with several ranks,
    any rank has (they stop together, as one worker would)."""
    return ranks.any([trainable])[0] if ranks is not None and ranks.active else trainable


def _optimizer_step(policy: Policy, optimizer: torch.optim.Optimizer, ranks: RankGroup | None) -> float:
    """Sum the gradients over the ranks (FSDP has reduce-scattered them already), clip them and step;
    the gradient norm before clipping (the global one)."""
    if ranks is not None and policy.fsdp is None:
        ranks.sum_gradients(policy.model.parameters())
    norm = float(full_value(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), policy.options.max_grad_norm)))
    optimizer.step()
    return norm


def _phase(policy: Policy, phase: str) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer of ``phase`` and the prefix of its metric names."""
    return policy.optimizer_for(phase), "" if phase == POLICY_PHASE else f"{phase}_"


def _idle_phase_steps(policy: Policy, phase: str, iterations: int, ranks: RankGroup) -> dict[str, float]:
    """A rank without rows of ``phase`` takes part in its optimizer steps with a zero gradient."""
    optimizer, prefix = _phase(policy, phase)
    stats: dict[str, float] = {}
    steps = 0
    for _ in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        if not _goes_on(ranks, False):  # the ranks with rows found nothing to train: all stop
            break
        stats[prefix + "grad_norm"] = _optimizer_step(policy, optimizer, ranks)
        steps += 1
        stats[prefix + "loss"] = 0.0
    stats[prefix + "optimizer_steps"] = steps
    return stats


class _Slot:
    """One micro-batch of a phase as tensors, kept over the phase's iterations (its PPO and KL
    references are taken once); ``None`` rows: a one-token dummy row with a zero loss (a rank of a
    sharded policy with fewer micro-batches than another runs these, so every rank runs the same
    forwards and backwards)."""

    def __init__(self, micro: MicroBatch[BoundKind, TrainRow] | None, policy: Policy) -> None:
        rows = [r for _, rs in micro.parts for r in rs] if micro is not None else []
        self.prompts = [r.prompt_ids for r in rows] or [[policy.pad_id]]
        self.completions = [r.completion_ids for r in rows] or [[policy.pad_id]]
        self.width = max(max(len(c) for c in self.completions), 1)
        self.forward_tokens = micro.forward_tokens if micro is not None else 0
        self.parts: list[_Part] = []
        start = 0
        for kind, rs in micro.parts if micro is not None else ():
            self.parts.append(_Part(kind, rs, start, self.width, policy.device))
            start += len(rs)

    def take_reference(self, policy: Policy, sharded_needs: bool) -> None:
        """The frozen reference's log-probs of this micro-batch's KL rows (no gradient); under FSDP a
        forward on every rank whenever some rank needs one."""
        kl = [p for p in self.parts if p.kind.term.uses_kl] if policy.options.beta > 0 else []
        if not kl and not (sharded_needs and policy.options.beta > 0):
            return
        kl_rows = [r for p in kl for r in p.rows]
        ref = policy.logprobs([r.prompt_ids for r in kl_rows] or [[policy.pad_id]],
                              [r.completion_ids for r in kl_rows] or [[policy.pad_id]], self.width, reference=True)
        at = 0
        for p in kl:
            p.ref, at = ref[at:at + len(p.rows)], at + len(p.rows)


def _slot_loss(policy: Policy, slot: _Slot, it: int, counts: BatchCounts, is_cap: float | None,
               merged: StatMerger) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One micro-batch's forward and its share of the phase's loss (each term reduced over the whole
    batch's counts, so the shares sum to the one-batch loss): (loss, the log-probs, the policy-gradient
    part of the loss). Its statistics go to ``merged``, weighted by its tokens."""
    opts, dev = policy.options, policy.device
    lp_all = policy.logprobs(slot.prompts, slot.completions, slot.width)
    total = torch.zeros((), device=dev)
    pg_total = 0.0
    for p in slot.parts:
        logp = lp_all[p.sl]
        cur = logp.detach()
        tokens = float(p.mask.sum())
        if it == 0 and p.kind.term.needs_reference:  # before any step here: the trainer's own reference
            p.old = cur
            if p.behavior is not None:
                merged.add(mismatch_stats(cur, p.behavior, p.mask), tokens)
                if is_cap is not None:  # the sampler's weight against the trainer's reference
                    p.correction = torch.where(p.mask, torch.exp(cur - p.behavior).clamp(max=is_cap),
                                               torch.ones_like(cur))
                    mean = float(p.correction[p.mask].mean()) if bool(p.mask.any()) else 1.0
                    merged.add({"is_weight_mean": mean}, tokens)
        weights, w_stats = p.kind.token_weights(p.rows, cur, slot.width)  # from this pass: the policy moved
        if it == 0:
            merged.add(w_stats, tokens)
        term = p.kind.term
        per_token, t_stats = term.fn(TermInputs(logp, p.mask, p.advantages, p.row_weight, opts, old_logp=p.old,
                                                ref_logp=p.ref, token_weight=weights if weights is not None
                                                else p.correction, token_advantages=p.token_advantages))
        share = reduce(per_token, p.mask, term.reduction, counts, opts)
        total = total + share
        if term.reduction == "policy_gradient":
            pg_total += float(share.detach())
        merged.add({_stat_key(p.kind.name, k): v for k, v in t_stats.items()}, tokens)
    return total, lp_all, pg_total


def _phase_slots(policy: Policy, parts_rows: Sequence[tuple[BoundKind, list[TrainRow]]],
                 ranks: RankGroup | None) -> list[_Slot]:
    """The phase's micro-batches (:mod:`mutualrl.algorithms.micro_batch`, at most
    ``policy.micro_batch_tokens`` forward tokens each, whole prompt groups) as slots. Under FSDP the
    ranks agree on their number and a rank with fewer pads with dummy slots."""
    micro: list[MicroBatch[BoundKind, TrainRow] | None] = list(split_micro_batches(
        parts_rows, policy.micro_batch_tokens, policy.trains_on_shared_prompts))
    n_micro = max(1, len(micro))
    if policy.fsdp is not None and ranks is not None and ranks.active:
        n_micro = int(ranks.max([n_micro])[0])
    micro += [None] * (n_micro - len(micro))
    return [_Slot(mb, policy) for mb in micro]


def _micro_step(policy: Policy, slot: _Slot, measure: bool, it: int, counts: BatchCounts, is_cap: float | None,
                merged: StatMerger, stats: dict[str, float]) -> tuple[float, float, bool]:
    """One micro-batch's forward and backward (its gradient accumulates): (its loss, its policy-gradient
    part, whether it had anything to train). ``measure``: count the bytes its forward keeps per token
    (``act_bytes_per_token``: not under FSDP, whose gathered weights would count as activations)."""
    if measure:
        with SavedBytes(policy.model) as saved:
            total, lp_all, pg = _slot_loss(policy, slot, it, counts, is_cap, merged)
        stats["act_bytes_per_token"] = saved.total / slot.forward_tokens
    else:
        total, lp_all, pg = _slot_loss(policy, slot, it, counts, is_cap, merged)
    if policy.fsdp is not None:  # FSDP reduce-scatters in the backward: every rank runs it, loss or not
        (total + lp_all.sum() * 0.0).backward()
    elif total.requires_grad:
        total.backward()
    return float(total.detach()), pg, total.requires_grad


def _phase_steps(policy: Policy, phase: str, parts_rows: Sequence[tuple[BoundKind, list[TrainRow]]],
                 counts: BatchCounts, iterations: int, is_cap: float | None,
                 ranks: RankGroup | None = None, needs_reference: bool = False) -> dict[str, float]:
    """``iterations`` optimizer steps of ``phase`` on its rows, each accumulated over the phase's
    micro-batches (:func:`_phase_slots`): a forward and a backward per micro-batch
    (:func:`_micro_step`), then one optimizer step.

    ``needs_reference``: some kind of the phase, on some rank, takes the KL term. Under FSDP every rank
    makes the same forwards and backwards (the reference forward too, whenever it is needed anywhere);
    replicated ranks sum their gradients once per optimizer step and need no such agreement."""
    sharded = policy.fsdp is not None
    if not any(rs for _, rs in parts_rows) and not sharded:
        assert ranks is not None and ranks.active
        return _idle_phase_steps(policy, phase, iterations, ranks)
    slots = _phase_slots(policy, parts_rows, ranks)
    optimizer, prefix = _phase(policy, phase)
    stats: dict[str, float] = {}
    steps = 0
    for it in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        merged = StatMerger()
        loss, pg_loss, trainable = 0.0, 0.0, False
        for j, slot in enumerate(slots):
            if it == 0:
                slot.take_reference(policy, sharded and needs_reference)
            measure = it == 0 and j == 0 and phase == POLICY_PHASE and bool(slot.forward_tokens) and not sharded
            part_loss, pg, has_grad = _micro_step(policy, slot, measure, it, counts, is_cap, merged, stats)
            loss, pg_loss, trainable = loss + part_loss, pg_loss + pg, trainable or has_grad
        stats.update(merged.result())
        if not _goes_on(ranks, trainable):
            break  # nothing to train here (on any rank)
        stats[prefix + "grad_norm"] = _optimizer_step(policy, optimizer, ranks)
        steps += 1
        stats[prefix + "loss"] = loss
        if any(p.kind.term.reduction == "policy_gradient" for s in slots for p in s.parts):
            stats[prefix + "pg_loss"] = pg_loss
    stats[prefix + "optimizer_steps"] = steps
    stats[prefix + "micro_batches"] = len(slots)
    return stats


def train_on_batch(policy: Policy, batch: TrainBatch, *, is_cap: float | None = None,
                   counts: BatchCounts | None = None, ranks: RankGroup | None = None) -> dict[str, float]:
    """Train on ``batch``: the policy's phase (``num_iterations`` optimizer steps), then each phase of
    its own a row kind asks for (one step each); the loss statistics.

    With ``is_cap`` each on-policy token's loss is weighted by the truncated importance weight
    ``min(exp(trainer - sampler), is_cap)`` of the sampler/trainer mismatch (as TRL and verl offer
    for vLLM). ``counts``: the reductions' denominators, when the batch is one rank's part of a
    larger one (default: this batch's own, :func:`batch_counts`, summed over ``ranks`` when the
    policy trains on several: see the module doc).
    """
    if not batch.kinds:  # a batch built by hand: the base step's own rows
        batch = dataclasses.replace(batch, kinds=bound_kinds(batch))
    counts = counts or batch_counts(batch, policy.options.num_generations)
    phases: dict[str, list[tuple[BoundKind, list[TrainRow]]]] = {}
    for name, kind in batch.kinds.items():
        rows = [r for r in batch.rows if r.kind == name]
        if rows or (ranks is not None and ranks.active):
            phases.setdefault(kind.phase, []).append((kind, rows))
    if ranks is not None and ranks.active:  # every rank: the same phases, the whole step's counts
        names = sorted(phases)
        present = ranks.any([any(rs for _, rs in phases[ph]) for ph in names])
        phases = {ph: [(k, rs) for k, rs in phases[ph] if rs] for ph, keep in zip(names, present, strict=True) if keep}
        prompts = counts.prompts if batch.rows or batch.n_prompts else 0  # an empty rank adds no prompt
        counts = BatchCounts(*(round(v) for v in ranks.sum([counts.sequences, counts.tokens, prompts])))
    if not phases:
        return {"loss": 0.0, "optimizer_steps": 0}
    policy.model.train()
    stats: dict[str, float] = {"optimizer_steps": 0}
    order = sorted(phases, key=lambda ph: ph != POLICY_PHASE)  # the policy's step first
    total_steps = 0
    for phase in order:
        iterations = policy.options.num_iterations if phase == POLICY_PHASE else 1
        needs_reference = any(k.term.uses_kl for k in batch.kinds.values() if k.phase == phase)
        out = _phase_steps(policy, phase, phases[phase], counts, iterations, is_cap, ranks, needs_reference)
        prefix = "" if phase == POLICY_PHASE else f"{phase}_"
        total_steps += int(out.pop(prefix + "optimizer_steps"))
        stats.update(out)
    stats["optimizer_steps"] = total_steps
    return stats


def update_flops(batch: TrainBatch, params: int, options: GRPOOptions) -> float:
    """The update's FLOPs, the usual dense estimate: 6 x parameters per token of a forward and backward
    (prompt and completion of every row), ``num_iterations`` times for the rows of the policy's
    phase and once for a kind with an optimizer step of its own, plus 2 x parameters per token of
    the frozen reference's forward when ``beta`` > 0 (what a compute-matched control is matched on)."""
    kinds = bound_kinds(batch)
    total = 0.0
    for r in batch.rows:
        tokens = len(r.prompt_ids) + len(r.completion_ids)
        passes = options.num_iterations if kinds[r.kind].phase == POLICY_PHASE else 1
        total += 6.0 * params * tokens * passes + (2.0 * params * tokens if options.beta > 0 else 0.0)
    return total
