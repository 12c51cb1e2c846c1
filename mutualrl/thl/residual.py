"""The THL residual: what an alignment between two tokenizations cannot preserve exactly.

Per alignment (:class:`Residual`) and per tokenizer pair over many texts (:class:`PairReport`):

* **round trip** -- does ``decode(encode(text)) == text`` on each side?
* **lost characters** -- characters of the text a side does not reproduce on decoding (unknown
  tokens, lower-casing, accent stripping, NFKC, dropped control characters); found by diffing the
  decoded text against the original. Chunks touching them are *inexact*.
* **non-1:1 text** -- fraction of characters in chunks that are not one token on each side
  (there a per-token value has to be spread or summed).
* **chunk size** -- mean and max tokens per chunk.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mutualrl.thl.retokenize import decode

if TYPE_CHECKING:
    from mutualrl.thl.align import Alignment

__all__ = ["PairReport", "Residual", "compute_residual", "lost_spans", "pair_report"]


def lost_spans(text: str, decoded: str) -> tuple[list[tuple[int, int]], int]:
    """Spans of ``text`` that ``decoded`` does not reproduce, and how many characters it inserts.

    Spans are half-open character ranges; a pure insertion at position ``p`` is reported as the
    empty span ``(p, p)``.
    """
    if text == decoded:
        return [], 0
    # strip the common prefix and suffix first: differences are usually local and sparse
    n = min(len(text), len(decoded))
    p = 0
    while p < n and text[p] == decoded[p]:
        p += 1
    q = 0
    while q < n - p and text[-1 - q] == decoded[-1 - q]:
        q += 1
    a, b = text[p : len(text) - q], decoded[p : len(decoded) - q]
    spans: list[tuple[int, int]] = []
    inserted = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag in ("replace", "delete"):
            spans.append((p + i1, p + i2))
        if tag == "insert":
            spans.append((p + i1, p + i1))
        if tag in ("replace", "insert"):
            inserted += max(0, (j2 - j1) - (i2 - i1))
    return spans, inserted


@dataclass(frozen=True)
class Residual:
    """Residual of one :class:`~mutualrl.thl.align.Alignment` (round-trip fields ``None`` if unknown)."""

    n_chars: int
    n_chunks: int
    one_to_one_chunks: int
    non_1to1_chars: int
    mean_chunk_tokens: float
    max_chunk_tokens: int
    unprojectable_chunks: int
    source_roundtrip: bool | None
    target_roundtrip: bool | None
    source_lost: tuple[tuple[int, int], ...]
    target_lost: tuple[tuple[int, int], ...]
    source_lost_chars: int
    target_lost_chars: int
    inexact_chunks: int
    exact_mask: np.ndarray

    @property
    def non_1to1_char_frac(self) -> float:
        """Fraction of the text in chunks that are not 1:1 (0 for empty text)."""
        return self.non_1to1_chars / self.n_chars if self.n_chars else 0.0


def _spans_to_chunks(spans: Sequence[tuple[int, int]], char_bounds: np.ndarray, mask: np.ndarray) -> None:
    """Clear ``mask`` for every chunk a lost span touches (an insertion: only strictly inside)."""
    starts, ends = char_bounds[:-1], char_bounds[1:]
    for s, e in spans:
        if e > s:
            mask &= ~((starts < e) & (ends > s))
        else:
            mask &= ~((starts < s) & (ends > s))


def compute_residual(al: Alignment, source_tokenizer: Any, target_tokenizer: Any) -> Residual:
    """The residual of one alignment; decodes each side once if its tokenizer is given."""
    ns = np.diff(al.source_bounds)
    nt = np.diff(al.target_bounds)
    sizes = np.diff(al.char_bounds)
    one = (ns == 1) & (nt == 1)
    k = len(sizes)
    exact = np.ones(k, dtype=bool)
    lost: list[tuple[tuple[int, int], ...]] = []
    lost_chars: list[int] = []
    rts: list[bool | None] = []
    for tok, enc in ((source_tokenizer, al.source), (target_tokenizer, al.target)):
        if tok is None:
            lost.append(())
            lost_chars.append(0)
            rts.append(None)
            continue
        spans, _ = lost_spans(al.text, decode(tok, enc.ids))
        rts.append(not spans)
        lost.append(tuple(spans))
        lost_chars.append(sum(e - s for s, e in spans))
        _spans_to_chunks(spans, al.char_bounds, exact)
    both = np.maximum(ns, nt)
    return Residual(
        n_chars=len(al.text),
        n_chunks=k,
        one_to_one_chunks=int(one.sum()),
        non_1to1_chars=int(sizes[~one].sum()),
        mean_chunk_tokens=float((ns + nt).mean() / 2) if k else 0.0,
        max_chunk_tokens=int(both.max()) if k else 0,
        unprojectable_chunks=int(((ns == 0) ^ (nt == 0)).sum()),
        source_roundtrip=rts[0],
        target_roundtrip=rts[1],
        source_lost=lost[0],
        target_lost=lost[1],
        source_lost_chars=lost_chars[0],
        target_lost_chars=lost_chars[1],
        inexact_chunks=int((~exact).sum()),
        exact_mask=exact,
    )


@dataclass(frozen=True)
class PairReport:
    """Residual of a tokenizer pair aggregated over texts."""

    texts: int
    chars: int
    source_roundtrip_fail_rate: float
    target_roundtrip_fail_rate: float
    roundtrip_fail_rate: float
    non_1to1_char_frac: float
    mean_chunk_tokens: float
    max_chunk_tokens: int
    source_lost_char_frac: float
    target_lost_char_frac: float
    inexact_chunk_frac: float
    unprojectable_chunks: int

    def as_dict(self) -> dict[str, float | int]:
        """Plain dict (JSON-ready)."""
        return asdict(self)


def pair_report(alignments: Sequence[Alignment]) -> PairReport:
    """Aggregate the residuals of many alignments of one tokenizer pair.

    ``roundtrip_fail_rate`` is the fraction of texts where at least one side fails to round-trip;
    character fractions are over all characters, ``mean_chunk_tokens`` over all chunks.
    """
    res = [a.residual for a in alignments]
    n = len(res)
    chars = sum(r.n_chars for r in res)
    chunks = sum(r.n_chunks for r in res)

    def rate(flags: list[bool | None]) -> float:
        return sum(1 for f in flags if f is False) / n if n else 0.0

    return PairReport(
        texts=n,
        chars=chars,
        source_roundtrip_fail_rate=rate([r.source_roundtrip for r in res]),
        target_roundtrip_fail_rate=rate([r.target_roundtrip for r in res]),
        roundtrip_fail_rate=(
            sum(1 for r in res if r.source_roundtrip is False or r.target_roundtrip is False) / n if n else 0.0
        ),
        non_1to1_char_frac=sum(r.non_1to1_chars for r in res) / chars if chars else 0.0,
        mean_chunk_tokens=sum(r.mean_chunk_tokens * r.n_chunks for r in res) / chunks if chunks else 0.0,
        max_chunk_tokens=max((r.max_chunk_tokens for r in res), default=0),
        source_lost_char_frac=sum(r.source_lost_chars for r in res) / chars if chars else 0.0,
        target_lost_char_frac=sum(r.target_lost_chars for r in res) / chars if chars else 0.0,
        inexact_chunk_frac=sum(r.inexact_chunks for r in res) / chunks if chunks else 0.0,
        unprojectable_chunks=sum(r.unprojectable_chunks for r in res),
    )
