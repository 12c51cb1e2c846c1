"""Token-budgeted micro-batches: a phase's rows cut into pieces whose forward fits the memory given.

An update's activations grow with the tokens that run through the model at once, so every forward
and backward of an update (each optimizer phase, the KL reference, the PPO reference when
``num_iterations > 1``) runs over micro-batches of at most ``micro_batch_tokens`` *forward tokens*,
with the gradients accumulated. A forward token is what the decoder actually processes: each
distinct prompt once (rows that share a prompt, a GRPO group, run it through the model once and
reuse its KV cache) plus every row's completion. This is verl's ``ppo_max_token_len_per_gpu``
(a budget in tokens, not TRL's ``per_device_train_batch_size`` in rows: rows of 30 and of 1,000
tokens differ 30x in memory, and a token budget holds the peak whatever the lengths).

A micro-batch holds whole prompt groups, in the order the rows came, so the shared-prompt
forward stays; a group larger than the budget is cut into pieces of rows (each piece re-runs the
prompt). Cutting changes only which rows share a forward: each term is reduced over counts of the
whole batch (:class:`~mutualrl.algorithms.losses.BatchCounts`), so the accumulated gradient is the
one-batch gradient (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")


class RowLike:
    """What a row needs for cutting: its prompt and completion token ids."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]


R = TypeVar("R", bound=RowLike)


@dataclass
class MicroBatch(Generic[K, R]):
    """One micro-batch: per kind (in the phase's kind order) the rows it holds."""

    parts: list[tuple[K, list[R]]]
    forward_tokens: int
    """Distinct prompts' tokens plus every completion's: what the decoder runs over."""

    @property
    def rows(self) -> int:
        return sum(len(rs) for _, rs in self.parts)


def forward_tokens(rows: Sequence[RowLike], share_prompts: bool = True) -> int:
    """The tokens a forward over ``rows`` runs: every completion, and each distinct prompt once
    (``share_prompts``) or once per row."""
    comp = sum(max(1, len(r.completion_ids)) for r in rows)
    if share_prompts:
        return comp + sum(len(p) for p in {tuple(r.prompt_ids) for r in rows})
    return comp + sum(len(r.prompt_ids) for r in rows)


def split_micro_batches(parts: Sequence[tuple[K, Sequence[R]]], budget: int | None,
                        share_prompts: bool = True) -> list[MicroBatch[K, R]]:
    """``parts`` (the phase's rows, kind by kind) cut into micro-batches of at most ``budget``
    forward tokens (``None``: one micro-batch). Rows are grouped by prompt across kinds, groups kept
    whole and in first-seen order; a group over the budget is cut into pieces of consecutive rows,
    and a single row over it is a micro-batch of its own. No micro-batch is empty, and every row is
    in exactly one."""
    kinds = [k for k, _ in parts]
    groups: dict[tuple[int, ...], list[tuple[int, R]]] = {}
    for ki, (_, rows) in enumerate(parts):
        for r in rows:
            groups.setdefault(tuple(r.prompt_ids), []).append((ki, r))
    if budget is None:
        pieces = [[e for g in groups.values() for e in g]] if groups else []
    else:
        pieces = []
        for prompt, members in groups.items():
            cur: list[tuple[int, R]] = []
            for e in members:
                cost = _cost(len(prompt), [*cur, e], share_prompts)
                if cur and cost > budget:
                    pieces.append(cur)
                    cur = []
                cur.append(e)
            if cur:
                pieces.append(cur)
    out: list[MicroBatch[K, R]] = []
    acc: list[tuple[int, R]] = []
    acc_tokens = 0
    for piece in pieces:
        t = forward_tokens([r for _, r in piece], share_prompts)
        if acc and budget is not None and acc_tokens + t > budget:
            out.append(_micro(kinds, acc, acc_tokens))
            acc, acc_tokens = [], 0
        acc.extend(piece)
        acc_tokens += t
    if acc:
        out.append(_micro(kinds, acc, acc_tokens))
    return out


def _cost(prompt_len: int, members: Sequence[tuple[int, RowLike]], share_prompts: bool) -> int:
    comp = sum(max(1, len(r.completion_ids)) for _, r in members)
    return comp + (prompt_len if share_prompts else prompt_len * len(members))


def _micro(kinds: list[K], entries: list[tuple[int, R]], tokens: int) -> MicroBatch[K, R]:
    by_kind: list[list[R]] = [[] for _ in kinds]
    for ki, r in entries:
        by_kind[ki].append(r)
    return MicroBatch([(k, rs) for k, rs in zip(kinds, by_kind, strict=True) if rs], tokens)


class StatMerger:
    """Statistics of a phase merged over its micro-batches: a mean weighted by the tokens each
    micro-batch reported it over; a ``*_max`` key the maximum, ``*_min`` the minimum."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._w: dict[str, float] = {}
        self._ext: dict[str, float] = {}

    def add(self, stats: dict[str, float], weight: float) -> None:
        for k, v in stats.items():
            if k.endswith("_max"):
                self._ext[k] = max(self._ext.get(k, v), v)
            elif k.endswith("_min"):
                self._ext[k] = min(self._ext.get(k, v), v)
            else:
                w = max(weight, 1e-12)
                self._sum[k] = self._sum.get(k, 0.0) + v * w
                self._w[k] = self._w.get(k, 0.0) + w

    def result(self) -> dict[str, float]:
        out = {k: s / self._w[k] for k, s in self._sum.items()}
        out.update(self._ext)
        return out
