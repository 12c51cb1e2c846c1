"""Hypothesis properties of THL alignment over arbitrary Unicode, for every ordered tokenizer pair.

Each example encodes the text once per tokenizer (4 real + 4 trained vocabularies) and checks
all 64 ordered pairs, so the pair loop costs little and every pair sees every example.
"""

from __future__ import annotations

import itertools

import numpy as np
from _thl_support import all_names, tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mutualrl.thl import Alignment, align_encodings, align_encodings_batch, encode, project_batch

NAMES = all_names()
PAIRS = list(itertools.product(NAMES, NAMES))

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# arbitrary Unicode, plus text shaped like the completions THL sees (digits, operators, spaces,
# a few multi-byte and normaliser-sensitive characters)
TEXTS = st.one_of(
    st.text(max_size=60),
    st.text(alphabet="0123456789 +-*/=().\n\tCalcuteAnswr:éÜ你🙂ﬁ½€\u00a0", max_size=80),
)


def _toks() -> dict[str, object]:
    return {n: tokenizer(n) for n in NAMES}  # built once per process (functools.cache)


def _all_alignments(text: str, toks: dict[str, object]) -> dict[tuple[str, str], Alignment]:
    encs = {n: encode(t, text) for n, t in toks.items()}
    return {
        (a, b): align_encodings(text, encs[a], encs[b], source_tokenizer=toks[a], target_tokenizer=toks[b])
        for a, b in PAIRS
    }


def _check_structure(al: Alignment, text: str) -> None:
    cb, sb, tb = al.char_bounds, al.source_bounds, al.target_bounds
    if not text:
        assert al.n_chunks == 0 and al.chunks == []
        return
    # chunk texts concatenate exactly to the input, in order
    assert "".join(al.chunk_text(k) for k in range(al.n_chunks)) == text
    assert cb[0] == 0 and cb[-1] == len(text) and np.all(np.diff(cb) >= 0)
    # every token of each side in exactly one chunk, chunks in token order
    for bounds, enc in ((sb, al.source), (tb, al.target)):
        assert bounds[0] == 0 and bounds[-1] == len(enc) and np.all(np.diff(bounds) >= 0)
        owner = np.repeat(np.arange(al.n_chunks), np.diff(bounds))
        assert len(owner) == len(enc)
        if len(enc):  # a token's text touches its chunk's text
            off = np.asarray(enc.offsets).reshape(-1, 2)
            assert np.all(off[:, 0] <= cb[owner + 1]) and np.all(off[:, 1] >= cb[owner])
    if len(al.source) and len(al.target):  # no chunk is empty on either side
        assert np.all(np.diff(sb) >= 1) and np.all(np.diff(tb) >= 1)


@SETTINGS
@given(text=TEXTS)
def test_chunks_partition_text_and_tokens(text: str) -> None:
    toks = _toks()
    for al in _all_alignments(text, toks).values():
        _check_structure(al, text)


@SETTINGS
@given(text=TEXTS, seed=st.integers(0, 2**32 - 1))
def test_project_preserves_chunk_and_total_sums(text: str, seed: int) -> None:
    toks = _toks()
    rng = np.random.default_rng(seed)
    for al in _all_alignments(text, toks).values():
        values = rng.normal(-3.0, 2.0, size=len(al.source))  # log-prob-like
        out = al.project(values)
        assert out.shape == (len(al.target),)
        if len(al.target) == 0:
            continue
        np.testing.assert_allclose(al.chunk_sums(out, "target"), al.chunk_sums(values, "source"), atol=1e-6)
        assert abs(out.sum() - values.sum()) <= 1e-6


@SETTINGS
@given(text=TEXTS)
def test_self_alignment_is_one_to_one(text: str) -> None:
    toks = _toks()
    for name, tok in toks.items():
        enc = encode(tok, text)
        al = align_encodings(text, enc, enc, source_tokenizer=tok, target_tokenizer=tok)
        if len(enc) == 0:  # e.g. WordPiece on whitespace: one chunk holding the text, no tokens
            assert al.n_chunks == (1 if text else 0)
            continue
        assert al.n_chunks == len(enc), name
        assert al.one_to_one().all(), (name, [c.kind for c in al.chunks])
        np.testing.assert_array_equal(al.project(np.arange(len(enc), dtype=float)), np.arange(len(enc)))


@SETTINGS
@given(text=TEXTS)
def test_reverse_alignment_has_same_boundaries(text: str) -> None:
    toks = _toks()
    als = _all_alignments(text, toks)
    for a, b in PAIRS:
        ab, ba = als[(a, b)], als[(b, a)]
        np.testing.assert_array_equal(ab.char_bounds, ba.char_bounds)
        np.testing.assert_array_equal(ab.source_bounds, ba.target_bounds)
        np.testing.assert_array_equal(ab.target_bounds, ba.source_bounds)


@settings(max_examples=25, deadline=None)
@given(texts=st.lists(TEXTS, max_size=6), pair=st.sampled_from(PAIRS))
def test_batch_equals_one_by_one(texts: list[str], pair: tuple[str, str]) -> None:
    toks = _toks()
    a, b = pair
    src = [encode(toks[a], t) for t in texts]
    tgt = [encode(toks[b], t) for t in texts]
    batch = align_encodings_batch(texts, src, tgt, source_tokenizer=toks[a], target_tokenizer=toks[b])
    assert len(batch) == len(texts)
    for text, s, t, al in zip(texts, src, tgt, batch):
        one = align_encodings(text, s, t, source_tokenizer=toks[a], target_tokenizer=toks[b])
        np.testing.assert_array_equal(al.char_bounds, one.char_bounds)
        np.testing.assert_array_equal(al.source_bounds, one.source_bounds)
        np.testing.assert_array_equal(al.target_bounds, one.target_bounds)
        _check_structure(al, text)
    values = [np.arange(len(s), dtype=float) * 0.5 - 3.0 for s in src]
    for got, al, v in zip(project_batch(batch, values), batch, values):
        np.testing.assert_allclose(got, al.project(v), rtol=0, atol=1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
def test_residual_counts_lost_text_and_never_drops_it(text: str) -> None:
    toks = _toks()
    for al in _all_alignments(text, toks).values():
        res = al.residual
        assert res.n_chars == len(text) and res.n_chunks == al.n_chunks
        assert 0 <= res.non_1to1_chars <= len(text)
        # round trip fails exactly when some text is lost or inserted on that side
        assert res.source_roundtrip == (not res.source_lost)
        assert res.target_roundtrip == (not res.target_lost)
        # every lost character lies in a chunk flagged inexact; merging puts each span in one chunk
        merged = al.merged_inexact()
        _check_structure(merged, text)
        for start, end in res.source_lost + res.target_lost:
            if end > start:
                hit = (al.char_bounds[:-1] < end) & (al.char_bounds[1:] > start)
                assert not res.exact_mask[hit].any()
                inside = (merged.char_bounds > start) & (merged.char_bounds < end)
                assert not inside.any()
