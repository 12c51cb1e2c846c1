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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import numpy as np

from mutualrl.thl.residual import Residual, compute_residual
from mutualrl.thl.retokenize import Encoded, backend_of, encode_batch

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


class Alignment:
    """Chunk alignment between a source and a target tokenization of ``text``.

    Stored as three boundary arrays of length ``n_chunks + 1``: character positions and source /
    target token indices; chunk ``k`` covers ``text[char_bounds[k]:char_bounds[k+1]]``, source
    tokens ``source_bounds[k]:source_bounds[k+1]`` and likewise on the target side.
    """

    __slots__ = (
        "_chunks",
        "_residual",
        "_source_tok",
        "_target_tok",
        "char_bounds",
        "source",
        "source_bounds",
        "target",
        "target_bounds",
        "text",
    )

    def __init__(
        self,
        text: str,
        source: Encoded,
        target: Encoded,
        char_bounds: np.ndarray,
        source_bounds: np.ndarray,
        target_bounds: np.ndarray,
        source_tokenizer: Any = None,
        target_tokenizer: Any = None,
    ) -> None:
        self.text = text
        self.source = source
        self.target = target
        self.char_bounds = char_bounds
        self.source_bounds = source_bounds
        self.target_bounds = target_bounds
        self._source_tok = source_tokenizer
        self._target_tok = target_tokenizer
        self._residual: Residual | None = None
        self._chunks: list[Chunk] | None = None

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
            self._residual = compute_residual(self, self._source_tok, self._target_tok)
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
                        self._source_tok, self._target_tok)
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


# ---------------------------------------------------------------------- the batch walk

#: Positions are kept in units of 1/_SCALE character. Where byte-level tokens split a character,
#: a cut after byte k (1..3) of it sits at sub-position k and the character goes to the chunk
#: holding its first byte. Tokens that share a character for other reasons (a normaliser
#: expanding it, a prepended SentencePiece space) are cut at sub-positions 4, 5, ... in order,
#: which only another tokenizer splitting the same character the same way can match; such a
#: character goes to the chunk of the last of those tokens.
_SCALE = 64
_BYTE_SUB = 4
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# id(tokenizer) -> (tokenizer, per-id byte length or None); the tokenizer is kept alive for the id
_BYTE_TABLES: dict[int, tuple[Any, np.ndarray | None]] = {}


def _byte_table(tokenizer: Any) -> np.ndarray | None:
    """UTF-8 byte length of every token id's text (``None`` if the tokenizer has no vocab)."""
    hit = _BYTE_TABLES.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    backend = backend_of(tokenizer)
    table: np.ndarray | None = None
    if backend is not None:
        vocab = backend.get_vocab(with_added_tokens=True)
        byte_level = "ByteLevel" in repr(backend.decoder) or "ByteLevel" in repr(backend.pre_tokenizer)
        table = np.zeros(max(vocab.values(), default=-1) + 1, dtype=np.int64)
        for tok, i in vocab.items():
            if byte_level:
                table[i] = len(tok)  # one alphabet character per byte
            elif _BYTE_FALLBACK.fullmatch(tok):
                table[i] = 1
            else:
                table[i] = len(tok.removeprefix("##").replace("\u2581", " ").encode("utf-8"))
    _BYTE_TABLES[id(tokenizer)] = (tokenizer, table)
    return table


def _offsets_flat(encs: Sequence[Encoded], counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    total = int(counts.sum())
    flat = np.fromiter(
        chain.from_iterable(chain.from_iterable(e.offsets for e in encs)), dtype=np.int64, count=2 * total
    )
    return flat[0::2], flat[1::2]


def _split_char_cuts(
    texts: Sequence[str],
    encs: Sequence[Encoded],
    table: np.ndarray | None,
    broken: np.ndarray,
    s: np.ndarray,
    ce: np.ndarray,
    tok_text: np.ndarray,
    first_tok: np.ndarray,
    base: np.ndarray,
    pos: np.ndarray,
    valid: np.ndarray,
) -> None:
    """Give sub-character cut positions to runs of tokens that share characters (in place).

    A run whose tokens' byte lengths add up to the UTF-8 length of the run's text is cut after
    each token at the byte where it ends; otherwise the run stays one unit.
    """
    if not len(broken):
        return
    runs = np.split(broken, np.nonzero(np.diff(broken) != 1)[0] + 1)
    for run in runs:
        i0, i1 = int(run[0]), int(run[-1]) + 1  # tokens i0..i1 overlap one another
        t = int(tok_text[i0])
        if int(tok_text[i1]) != t:
            continue
        if table is not None and _byte_cuts(texts[t], encs[t], table, i0, i1, first_tok[t], base[t], s, ce, pos):
            valid[i0:i1] = True
            continue
        # no byte accounting: keep sub-positions apart from byte cuts, one per token in order
        for i in range(i0, i1):
            char = (max(int(s[i + 1]), int(ce[i]) - _SCALE) // _SCALE) * _SCALE
            pos[i] = char + _BYTE_SUB + min(i - i0, _SCALE - _BYTE_SUB - 1)
        valid[i0:i1] = True


def _byte_cuts(
    text: str,
    enc: Encoded,
    table: np.ndarray,
    i0: int,
    i1: int,
    first: int,
    base: int,
    s: np.ndarray,
    ce: np.ndarray,
    pos: np.ndarray,
) -> bool:
    """Cut a run of tokens i0..i1 at the bytes where they end, if their byte lengths add up."""
    lo, hi = int(s[i0] - base) // _SCALE, int(ce[i1] - base) // _SCALE
    ids = enc.ids[i0 - first : i1 - first + 1]
    if max(ids) >= len(table):
        return False
    nbytes = table[np.asarray(ids)]
    char_bytes = [len(ch.encode("utf-8")) for ch in text[lo:hi]]
    if int(nbytes.sum()) != sum(char_bytes) or not char_bytes or nbytes.min() <= 0:
        return False
    ends = np.cumsum(nbytes)[:-1]
    char_end = np.cumsum(char_bytes)
    ci = np.searchsorted(char_end, ends, side="right")  # characters completed before the cut
    done = np.concatenate(([0], char_end))[ci]
    pos[i0:i1] = base + (lo + ci) * _SCALE + (ends - done)
    return True


def _side_cuts(
    texts: Sequence[str],
    encs: Sequence[Encoded],
    counts: np.ndarray,
    base: np.ndarray,
    lengths: np.ndarray,
    need_end: np.ndarray,
    tokenizer: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Cut candidates of one side for the whole batch (positions in 1/_SCALE characters).

    Returns strictly increasing global positions and the number of tokens (global count) before
    each candidate. Every text in ``need_end`` gets a candidate at its end.
    """
    starts, ends = _offsets_flat(encs, counts)
    ends_of_text = base + lengths * _SCALE
    n = len(starts)
    if n:
        if len(encs) == 1:  # a single text: scalars instead of per-token arrays
            tok_text = np.zeros(n, dtype=np.int64)
            lim, off = int(lengths[0]), int(base[0])
        else:
            tok_text = np.repeat(np.arange(len(encs)), counts)
            lim, off = lengths[tok_text], base[tok_text]
        s = np.maximum.accumulate(np.minimum(np.maximum(starts, 0), lim) * _SCALE + off)
        ce = np.maximum.accumulate(np.maximum(np.minimum(np.maximum(ends, 0), lim) * _SCALE + off, s))
        valid = np.empty(n, dtype=bool)
        np.less_equal(ce[:-1], s[1:], out=valid[:-1])
        pos = ce
        has = counts > 0
        last = np.cumsum(counts)[has] - 1
        valid[last] = True
        if not valid.all():
            table = _byte_table(tokenizer) if tokenizer is not None else None
            first_tok = np.cumsum(counts) - counts
            _split_char_cuts(texts, encs, table, np.nonzero(~valid)[0], s, ce, tok_text, first_tok,
                             base, pos, valid)
        pos[last] = ends_of_text[has]
        cnt = np.arange(1, n + 1, dtype=np.int64)[valid]
        pos = pos[valid]
    else:
        pos = np.zeros(0, dtype=np.int64)
        cnt = np.zeros(0, dtype=np.int64)
    lonely = (counts == 0) & need_end  # a text this side has no token for at all
    if lonely.any():
        before = (np.cumsum(counts) - counts)[lonely]
        at = np.searchsorted(cnt, before, side="right")
        pos = np.insert(pos, at, ends_of_text[lonely])
        cnt = np.insert(cnt, at, before)
    if len(pos) > 1:  # several candidates at one position (zero-width tokens): keep the last
        keep = np.empty(len(pos), dtype=bool)
        np.not_equal(pos[:-1], pos[1:], out=keep[:-1])
        keep[-1] = True
        pos, cnt = pos[keep], cnt[keep]
    return pos, cnt


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
    np.cumsum((lengths[:-1] + 1) * _SCALE, out=base[1:])
    na = np.fromiter((len(e.ids) for e in source), dtype=np.int64, count=len(texts))
    nb = np.fromiter((len(e.ids) for e in target), dtype=np.int64, count=len(texts))
    need_end = (lengths > 0) | (na > 0) | (nb > 0)
    pa, ca = _side_cuts(texts, source, na, base, lengths, need_end, source_tokenizer)
    pb, cb = _side_cuts(texts, target, nb, base, lengths, need_end, target_tokenizer)
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
    sub = gp % _SCALE
    gp //= _SCALE
    gp += (sub > 0) & (sub < _BYTE_SUB)  # a byte cut: the character goes with its first byte
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

