"""The batch walk of THL alignment: every tokenization's cut candidates, in units of sub-characters.

Each tokenization offers a cut candidate at the end of each token (:func:`side_cuts`, the whole
batch at once with numpy); :mod:`mutualrl.thl.align` keeps the positions both sides offer. Tokens
that split or share a character get sub-character positions, so byte-level pieces of one character
can still be cut at the byte where each ends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from mutualrl.thl.retokenize import Encoded, backend_of

#: Positions are kept in units of 1/SCALE character. Where byte-level tokens split a character,
#: a cut after byte k (1..3) of it sits at sub-position k and the character goes to the chunk
#: holding its first byte. Tokens that share a character for other reasons (a normaliser
#: expanding it, a prepended SentencePiece space) are cut at sub-positions 4, 5, ... in order,
#: which only another tokenizer splitting the same character the same way can match; such a
#: character goes to the chunk of the last of those tokens.
SCALE = 64
BYTE_SUB = 4
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
            char = (max(int(s[i + 1]), int(ce[i]) - SCALE) // SCALE) * SCALE
            pos[i] = char + BYTE_SUB + min(i - i0, SCALE - BYTE_SUB - 1)
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
    lo, hi = int(s[i0] - base) // SCALE, int(ce[i1] - base) // SCALE
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
    pos[i0:i1] = base + (lo + ci) * SCALE + (ends - done)
    return True


def side_cuts(
    texts: Sequence[str],
    encs: Sequence[Encoded],
    counts: np.ndarray,
    base: np.ndarray,
    lengths: np.ndarray,
    need_end: np.ndarray,
    tokenizer: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Cut candidates of one side for the whole batch (positions in 1/SCALE characters).

    Returns strictly increasing global positions and the number of tokens (global count) before
    each candidate. Every text in ``need_end`` gets a candidate at its end.
    """
    starts, ends = _offsets_flat(encs, counts)
    ends_of_text = base + lengths * SCALE
    n = len(starts)
    if n:
        if len(encs) == 1:  # a single text: scalars instead of per-token arrays
            tok_text = np.zeros(n, dtype=np.int64)
            lim, off = int(lengths[0]), int(base[0])
        else:
            tok_text = np.repeat(np.arange(len(encs)), counts)
            lim, off = lengths[tok_text], base[tok_text]
        s = np.maximum.accumulate(np.minimum(np.maximum(starts, 0), lim) * SCALE + off)
        ce = np.maximum.accumulate(np.maximum(np.minimum(np.maximum(ends, 0), lim) * SCALE + off, s))
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
