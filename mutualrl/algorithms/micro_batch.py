"""Token-budgeted micro-batches: a phase's rows cut into pieces whose forward fits the memory given.

An update's activations grow with the tokens that run through the model at once, so every forward
and backward of an update (each optimizer phase, the KL reference, the PPO reference when
``num_iterations > 1``) runs over micro-batches of at most ``micro_batch_tokens`` *forward tokens*,
with the gradients accumulated. A forward token is what the decoder actually processes, padding
included: each distinct prompt once (rows that share a prompt, a GRPO group, run it through the
model once and reuse its KV cache) plus every row's completion padded to the longest; without the
shared-prompt forward (gradient checkpointing, FSDP) every row's prompt and completion. This is verl's ``ppo_max_token_len_per_gpu``
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
    """What the decoder runs over, padding included (:func:`forward_tokens`)."""

    @property
    def rows(self) -> int:
        return sum(len(rs) for _, rs in self.parts)


class _Extent:
    """The padded size of a growing set of rows, as the forward lays them out: with shared prompts,
    the distinct prompts left-padded to the longest and the completions padded to the longest;
    without, every row's prompt and completion padded to the longest of them."""

    def __init__(self, share_prompts: bool) -> None:
        self.share = share_prompts
        self.prompts: set[tuple[int, ...]] = set()
        self.rows = self.max_prompt = self.max_completion = self.max_total = 0

    def tokens_with(self, rows: Sequence[RowLike]) -> int:
        """The forward tokens once ``rows`` join (nothing is added)."""
        prompts = self.prompts | {tuple(r.prompt_ids) for r in rows}
        n = self.rows + len(rows)
        mp = max([self.max_prompt, *(len(r.prompt_ids) for r in rows)])
        mc = max([self.max_completion, *(max(1, len(r.completion_ids)) for r in rows)])
        mt = max([self.max_total, *(len(r.prompt_ids) + max(1, len(r.completion_ids)) for r in rows)])
        return len(prompts) * mp + n * mc if self.share else n * mt

    def add(self, rows: Sequence[RowLike]) -> None:
        self.prompts |= {tuple(r.prompt_ids) for r in rows}
        self.rows += len(rows)
        self.max_prompt = max([self.max_prompt, *(len(r.prompt_ids) for r in rows)])
        self.max_completion = max([self.max_completion, *(max(1, len(r.completion_ids)) for r in rows)])
        self.max_total = max([self.max_total, *(len(r.prompt_ids) + max(1, len(r.completion_ids)) for r in rows)])

    @property
    def tokens(self) -> int:
        return self.tokens_with(())


def forward_tokens(rows: Sequence[RowLike], share_prompts: bool = True) -> int:
    """The tokens a forward over ``rows`` runs, padding included: the distinct prompts (each once,
    padded to the longest) and every completion padded to the longest (``share_prompts``), or every
    row's prompt and completion padded to the longest pair."""
    e = _Extent(share_prompts)
    e.add(rows)
    return e.tokens


def split_micro_batches(parts: Sequence[tuple[K, Sequence[R]]], budget: int | None,
                        share_prompts: bool = True) -> list[MicroBatch[K, R]]:
    """``parts`` (the phase's rows, kind by kind) cut into micro-batches of at most ``budget``
    forward tokens, padding included (:func:`forward_tokens`; ``None``: one micro-batch). Rows are
    grouped by prompt across kinds, groups kept whole and in first-seen order; a group over the
    budget is cut into pieces of consecutive rows, and a single row over it is a micro-batch of its
    own. No micro-batch is empty, and every row is in exactly one."""
    kinds = [k for k, _ in parts]
    groups: dict[tuple[int, ...], list[tuple[int, R]]] = {}
    for ki, (_, rows) in enumerate(parts):
        for r in rows:
            groups.setdefault(tuple(r.prompt_ids), []).append((ki, r))
    if budget is None:
        pieces = [[e for g in groups.values() for e in g]] if groups else []
    else:
        pieces = []
        for members in groups.values():
            cur: list[tuple[int, R]] = []
            ext = _Extent(share_prompts)
            for e in members:
                if cur and ext.tokens_with([e[1]]) > budget:
                    pieces.append(cur)
                    cur, ext = [], _Extent(share_prompts)
                cur.append(e)
                ext.add([e[1]])
            if cur:
                pieces.append(cur)
    out: list[MicroBatch[K, R]] = []
    acc: list[tuple[int, R]] = []
    ext = _Extent(share_prompts)
    for piece in pieces:
        rows = [r for _, r in piece]
        if acc and budget is not None and ext.tokens_with(rows) > budget:
            out.append(_micro(kinds, acc, ext.tokens))
            acc, ext = [], _Extent(share_prompts)
        acc.extend(piece)
        ext.add(rows)
    if acc:
        out.append(_micro(kinds, acc, ext.tokens))
    return out


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
