"""Align two tokenizations of the same text into chunks, and project token values across them.

Both tokenizations carry character offsets. Every gap between two consecutive tokens of one side
is a *cut candidate* at the end of the earlier token (text a tokenizer skips, such as the
whitespace WordPiece drops, joins the following token). Tokens whose spans overlap share a
character: byte-level pieces of one multi-byte character get cut candidates at the byte where
each ends; pieces from a normaliser expanding a character (or a prepended SentencePiece space)
get their own sub-character positions in order. A chunk boundary is placed wherever both sides
have a cut candidate at the same position, so every chunk is the smallest text span that both
sides tokenize in whole tokens: 1:1, 1:n, n:1 or n:m.

The walk is done for a whole batch at once with numpy (sorted positions, one ``searchsorted``),
so aligning costs a small fraction of encoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mutualrl.thl.cuts import BYTE_SUB, SCALE, side_cuts
from mutualrl.thl.residual import Residual, compute_residual
from mutualrl.thl.retokenize import Encoded, encode_batch

__all__ = [
    "Alignment",
    "Chunk",
    "align",
    "align_batch",
    "align_encodings",
    "align_encodings_batch",
    "project_batch",
]

Side = Literal["source", "target"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """A span of text and the token index ranges that cover it on each side."""

    char_start: int
    char_end: int
    source_tokens: range
    target_tokens: range

    @property
    def kind(self) -> str:
        """``"1:1"``, ``"1:n"``, ``"n:1"`` or ``"n:m"`` (a ``0`` where a side has no token)."""
        ns, nt = len(self.source_tokens), len(self.target_tokens)
        left = str(ns) if ns <= 1 else "n"
        right = str(nt) if nt <= 1 else ("m" if ns > 1 else "n")
        return f"{left}:{right}"


@dataclass(eq=False, repr=False, slots=True)
class Alignment:
    """Chunk alignment between a source and a target tokenization of ``text``.

    Stored as three boundary arrays of length ``n_chunks + 1``: character positions and source /
    target token indices; chunk ``k`` covers ``text[char_bounds[k]:char_bounds[k+1]]``, source
    tokens ``source_bounds[k]:source_bounds[k+1]`` and likewise on the target side.
    """

    text: str
    source: Encoded
    target: Encoded
    char_bounds: np.ndarray
    source_bounds: np.ndarray
    target_bounds: np.ndarray
    source_tokenizer: Any = None
    """The tokenizers the two sides came from (for the residual's decoding; optional)."""
    target_tokenizer: Any = None
    _residual: Residual | None = field(default=None, init=False)
    _chunks: list[Chunk] | None = field(default=None, init=False)

    # ------------------------------------------------------------------ structure
    @property
    def n_chunks(self) -> int:
        """Number of chunks (0 for empty text)."""
        return len(self.char_bounds) - 1

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks, in text order."""
        if self._chunks is None:
            c, s, t = (a.tolist() for a in (self.char_bounds, self.source_bounds, self.target_bounds))
            self._chunks = [
                Chunk(c[k], c[k + 1], range(s[k], s[k + 1]), range(t[k], t[k + 1]))
                for k in range(len(c) - 1)
            ]
        return self._chunks

    def chunk_text(self, k: int) -> str:
        """The text of chunk ``k``."""
        return self.text[int(self.char_bounds[k]) : int(self.char_bounds[k + 1])]

    def one_to_one(self) -> np.ndarray:
        """Boolean mask of chunks holding exactly one token on each side."""
        return (np.diff(self.source_bounds) == 1) & (np.diff(self.target_bounds) == 1)

    def _bounds(self, side: Side) -> np.ndarray:
        if side == "source":
            return self.source_bounds
        if side == "target":
            return self.target_bounds
        raise ValueError(f"side must be 'source' or 'target', got {side!r}")

    # ------------------------------------------------------------------ values
    def chunk_sums(self, values: Sequence[float] | np.ndarray, side: Side = "source") -> np.ndarray:
        """Sum of ``values`` (one per token of ``side``) within each chunk."""
        bounds = self._bounds(side)
        n = int(bounds[-1] - bounds[0]) if len(bounds) else 0
        enc = self.source if side == "source" else self.target
        return _chunk_sums(_as_values(values, len(enc), side), bounds, n)

    def project(self, values: Sequence[float] | np.ndarray) -> np.ndarray:
        """Map one value per source token to one value per target token.

        Each chunk's source sum is spread evenly over the chunk's target tokens, so every chunk
        sum (and the total) is preserved: use it for log-probs, whose chunk sums are the log-prob
        of the chunk's text on either side. If the target side has no token at all (WordPiece on
        pure whitespace), nothing can carry the sum: the result is empty and the chunk is counted
        in :attr:`Residual.unprojectable_chunks`.
        """
        v = _as_values(values, len(self.source), "source")
        if not len(self.target):
            return np.zeros(0, dtype=np.float64)
        tb = self.target_bounds
        counts = tb[1:] - tb[:-1]
        return np.repeat(_chunk_sums(v, self.source_bounds, len(v)) / counts, counts)

    # ------------------------------------------------------------------ residual
    @property
    def residual(self) -> Residual:
        """What this alignment cannot preserve exactly (computed on first access, then cached).

        Needs the tokenizers (to decode): alignments built from bare encodings without
        tokenizers report round-trip fields as ``None``.
        """
        if self._residual is None:
            self._residual = compute_residual(self, self.source_tokenizer, self.target_tokenizer)
        return self._residual

    def exact(self) -> np.ndarray:
        """Boolean mask of chunks whose text both sides reproduce exactly (see :attr:`residual`)."""
        return self.residual.exact_mask

    def merged_inexact(self) -> Alignment:
        """A coarser alignment where every span that does not round-trip lies inside one chunk."""
        spans = list(self.residual.source_lost) + list(self.residual.target_lost)
        if not spans:
            return self
        cuts = self.char_bounds[1:-1]
        keep_inner = np.ones(len(cuts), dtype=bool)
        for start, end in spans:
            keep_inner &= ~((cuts > start) & (cuts < max(end, start + 1)))
        keep = np.concatenate(([True], keep_inner, [True]))
        out = Alignment(self.text, self.source, self.target, self.char_bounds[keep],
                        self.source_bounds[keep], self.target_bounds[keep],
                        self.source_tokenizer, self.target_tokenizer)
        return out

    def __repr__(self) -> str:
        return (f"Alignment(chars={len(self.text)}, chunks={self.n_chunks}, "
                f"source_tokens={len(self.source)}, target_tokens={len(self.target)})")


def _as_values(values: Sequence[float] | np.ndarray, n: int, side: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.shape[0] != n:
        raise ValueError(f"expected one value per {side} token: a 1-D array of length {n}, got shape {v.shape}")
    return v


def _chunk_sums(v: np.ndarray, bounds: np.ndarray, n: int) -> np.ndarray:
    k = len(bounds) - 1
    if k <= 0:
        return np.zeros(0, dtype=np.float64)
    sizes = bounds[1:] - bounds[:-1]
    if n and sizes.min() > 0:
        return np.add.reduceat(v, bounds[:-1])
    ids = np.repeat(np.arange(k), sizes)
    return np.bincount(ids, weights=v, minlength=k).astype(np.float64)


def project_batch(alignments: Sequence[Alignment], values: Sequence[Sequence[float] | np.ndarray]) -> list[np.ndarray]:
    """:meth:`Alignment.project` for many alignments at once (one vectorised pass).

    ``values[i]`` holds one value per source token of ``alignments[i]``; returns one array per
    alignment, exactly as ``[al.project(v) for al, v in zip(alignments, values)]`` would.
    """
    if len(alignments) != len(values):
        raise ValueError(f"expected one values array per alignment ({len(alignments)}), got {len(values)}")
    if not alignments:
        return []
    vs = [_as_values(v, len(al.source), "source") for al, v in zip(alignments, values)]
    # alignments with an empty side (rare) take the one-by-one path
    full = [bool(len(al.source) and len(al.target)) for al in alignments]
    out: list[np.ndarray | None] = [None if f else al.project(v) for al, v, f in zip(alignments, vs, full)]
    idx = [i for i, f in enumerate(full) if f]
    if idx:
        src_len = np.fromiter((len(vs[i]) for i in idx), dtype=np.int64, count=len(idx))
        src_off = np.cumsum(src_len) - src_len
        starts = np.concatenate([alignments[i].source_bounds[:-1] + o for i, o in zip(idx, src_off.tolist())])
        tb = np.concatenate([alignments[i].target_bounds for i in idx])
        nchunks = np.fromiter((alignments[i].n_chunks for i in idx), dtype=np.int64, count=len(idx))
        counts = tb[1:] - tb[:-1]
        # drop the differences that straddle two alignments
        keep = np.ones(len(counts), dtype=bool)
        keep[(np.cumsum(nchunks + 1) - 1)[:-1]] = False
        counts = counts[keep]
        flat = np.repeat(np.add.reduceat(np.concatenate([vs[i] for i in idx]), starts) / counts, counts)
        tgt_len = np.fromiter((len(alignments[i].target) for i in idx), dtype=np.int64, count=len(idx))
        for i, piece in zip(idx, np.split(flat, np.cumsum(tgt_len)[:-1])):
            out[i] = piece
    return out  # type: ignore[return-value]


def align_encodings_batch(
    texts: Sequence[str],
    source: Sequence[Encoded],
    target: Sequence[Encoded],
    *,
    source_tokenizer: Any = None,
    target_tokenizer: Any = None,
) -> list[Alignment]:
    """Align already-computed encodings (``Encoded``, one per text on each side).

    Pass the tokenizers too: they let byte-level tokens that split a character be cut at the
    byte, and :attr:`Alignment.residual` report round trips.
    """
    if not (len(texts) == len(source) == len(target)):
        raise ValueError(
            f"expected one source and one target encoding per text, got {len(texts)} texts, "
            f"{len(source)} source and {len(target)} target encodings"
        )
    for t in texts:
        if not isinstance(t, str):
            raise TypeError(f"text must be a str, got {type(t).__name__}")
    if not texts:
        return []
    lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    base = np.zeros(len(texts), dtype=np.int64)
    np.cumsum((lengths[:-1] + 1) * SCALE, out=base[1:])
    na = np.fromiter((len(e.ids) for e in source), dtype=np.int64, count=len(texts))
    nb = np.fromiter((len(e.ids) for e in target), dtype=np.int64, count=len(texts))
    need_end = (lengths > 0) | (na > 0) | (nb > 0)
    pa, ca = side_cuts(texts, source, na, base, lengths, need_end, source_tokenizer)
    pb, cb = side_cuts(texts, target, nb, base, lengths, need_end, target_tokenizer)
    idx = np.searchsorted(pb, pa)
    hit = idx < len(pb)
    hit[hit] = pb[idx[hit]] == pa[hit]
    jp, ja, jb = pa[hit], ca[hit], cb[idx[hit]]
    # put a start entry in front of every text's cuts, then make everything text-local
    first = np.searchsorted(jp, base, side="left")
    before_a = np.cumsum(na) - na
    before_b = np.cumsum(nb) - nb
    gp = np.insert(jp, first, base)
    ga = np.insert(ja, first, before_a)
    gb = np.insert(jb, first, before_b)
    stop = np.empty(len(texts), dtype=np.int64)
    stop[:-1] = first[1:]
    stop[-1] = len(jp)
    ar = np.arange(len(texts), dtype=np.int64)
    begin_i = first + ar
    end_i = stop + ar + 1
    text_of = np.repeat(ar, end_i - begin_i)
    gp -= base[text_of]
    sub = gp % SCALE
    gp //= SCALE
    gp += (sub > 0) & (sub < BYTE_SUB)  # a byte cut: the character goes with its first byte
    ga -= before_a[text_of]
    gb -= before_b[text_of]
    b_list, e_list = begin_i.tolist(), end_i.tolist()
    return [
        Alignment(texts[i], source[i], target[i], gp[b:e], ga[b:e], gb[b:e], source_tokenizer, target_tokenizer)
        for i, (b, e) in enumerate(zip(b_list, e_list))
    ]


def align_encodings(
    text: str,
    source: Encoded,
    target: Encoded,
    *,
    source_tokenizer: Any = None,
    target_tokenizer: Any = None,
) -> Alignment:
    """Align one text's already-computed source and target encodings."""
    return align_encodings_batch(
        [text], [source], [target], source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer
    )[0]


def align_batch(texts: Sequence[str], source_tokenizer: Any, target_tokenizer: Any) -> list[Alignment]:
    """Encode ``texts`` with both tokenizers (batched) and align each."""
    texts = list(texts)
    src = encode_batch(source_tokenizer, texts)
    tgt = encode_batch(target_tokenizer, texts)
    return align_encodings_batch(
        texts, src, tgt, source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer
    )


def align(text: str, source_tokenizer: Any, target_tokenizer: Any, *, merge_inexact: bool = False) -> Alignment:
    """Align ``text`` as tokenized by ``source_tokenizer`` and by ``target_tokenizer``.

    With ``merge_inexact`` every span that one side does not reproduce on decoding is merged
    into a single chunk (see :meth:`Alignment.merged_inexact`). Empty text gives zero chunks.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    out = align_batch([text], source_tokenizer, target_tokenizer)[0]
    return out.merged_inexact() if merge_inexact else out

