"""Unit tests of THL alignment, projection and residual on hand-picked cases."""

from __future__ import annotations

import numpy as np
import pytest
from _thl_support import tokenizer

from mutualrl.thl import align, align_batch, align_encodings, encode, lost_spans, pair_report


def _kinds(al):
    return [(al.chunk_text(k), c.kind) for k, c in enumerate(al.chunks)]


def test_empty_text_has_zero_chunks() -> None:
    al = align("", tokenizer("smollm2"), tokenizer("gemma3"))
    assert al.n_chunks == 0 and al.chunks == []
    assert al.project([]).shape == (0,)
    assert al.chunk_sums([], "target").shape == (0,)
    assert al.residual.non_1to1_char_frac == 0.0


@pytest.mark.parametrize("bad", [None, b"bytes", 3, ["a"]])
def test_non_string_text_is_a_type_error(bad) -> None:
    with pytest.raises(TypeError, match="text must be a str"):
        align(bad, tokenizer("smollm2"), tokenizer("gemma3"))


def test_tokenizer_without_offsets_or_decode_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="encode\\(text\\) and decode\\(ids\\)"):
        align("abc", object(), tokenizer("gemma3"))


def test_project_checks_value_length() -> None:
    al = align("Hello world", tokenizer("smollm2"), tokenizer("minilm"))
    with pytest.raises(ValueError, match=f"length {len(al.source)}"):
        al.project(np.zeros(len(al.source) + 1))
    with pytest.raises(ValueError, match="1-D"):
        al.project(np.zeros((len(al.source), 2)))
    with pytest.raises(ValueError, match=f"length {len(al.target)}"):
        al.chunk_sums(np.zeros(len(al.source) + 5), "target")
    with pytest.raises(ValueError, match="side must be"):
        al.chunk_sums(np.zeros(len(al.source)), "middle")


def test_sentencepiece_space_and_bpe_space_line_up() -> None:
    al = align("Hello world, 12 + 30 = 42", tokenizer("gemma3"), tokenizer("smollm2"))
    texts = [al.chunk_text(k) for k in range(al.n_chunks)]
    assert texts[:3] == ["Hello", " world", ","]
    assert al.chunks[1].kind == "1:1"  # '▁world' vs 'Ġworld'


def test_wordpiece_prefix_and_dropped_spaces() -> None:
    text = "Calculate tokenization sums"
    al = align(text, tokenizer("minilm"), tokenizer("smollm2"))
    pieces = tokenizer("minilm").encode(text, add_special_tokens=False).tokens
    assert any(p.startswith("##") for p in pieces)
    assert "".join(al.chunk_text(k) for k in range(al.n_chunks)) == text
    # the space WordPiece drops belongs to the chunk of the following word
    assert al.chunk_text(1).startswith(" ")
    res = al.residual
    assert res.source_roundtrip is False and res.source_lost == ((0, 1),)  # 'C' came back lower-cased
    assert res.target_roundtrip is True
    assert not res.exact_mask[0] and res.exact_mask[1:].all()


def test_byte_level_tokens_splitting_a_character() -> None:
    text = "x 你好"
    smol = tokenizer("smollm2")
    enc = encode(smol, text)
    shared = [o for o in enc.offsets if o == (2, 3)]
    assert len(shared) == 2  # '你' is two byte-level tokens
    al = align(text, smol, tokenizer("t_char"))
    by_text = dict(_kinds(al))
    assert by_text["你"] == "n:1"  # both byte pieces against the one character token
    # against itself each byte piece is its own chunk (the second holds no whole character)
    self_al = align(text, smol, smol)
    assert self_al.one_to_one().all() and self_al.n_chunks == len(enc)
    assert "".join(self_al.chunk_text(k) for k in range(self_al.n_chunks)) == text


def test_same_byte_split_matches_across_byte_level_tokenizers() -> None:
    text = "你好"
    al = align(text, tokenizer("smollm2"), tokenizer("cl100k"))
    assert "".join(al.chunk_text(k) for k in range(al.n_chunks)) == text
    values = np.array([-1.0, -2.0, -3.0, -4.0][: len(al.source)])
    out = al.project(values)
    assert out.sum() == pytest.approx(values.sum())


def test_nfkc_expansion_and_unknown_tokens_are_residual_not_dropped() -> None:
    text = "ﬁ = 1 €"
    uni = tokenizer("t_unigram")  # NFKC: 'ﬁ' -> 'f', 'i'; '€' is not in its vocabulary
    al = align(text, uni, tokenizer("smollm2"))
    res = al.residual
    assert res.source_roundtrip is False
    lost = set(res.source_lost)
    assert (0, 1) in lost  # 'ﬁ' comes back as 'fi'
    assert res.source_lost_chars >= 2
    assert res.inexact_chunks >= 2
    # all characters still sit in chunks, and the values on them are kept
    assert "".join(al.chunk_text(k) for k in range(al.n_chunks)) == text
    values = np.linspace(-1, -2, len(al.source))
    assert al.project(values).sum() == pytest.approx(values.sum())


def test_many_tokens_inside_one_character() -> None:
    text = "\ufdfa \ufdfa"  # NFKC expands this one character into four words: 8 tokens share it
    uni = tokenizer("t_unigram")
    enc = encode(uni, text)
    assert sum(1 for o in enc.offsets if o == (0, 1)) >= 8
    self_al = align(text, uni, uni)
    assert self_al.one_to_one().all() and self_al.n_chunks == len(enc)
    other = align(text, uni, tokenizer("smollm2"))
    assert "".join(other.chunk_text(k) for k in range(other.n_chunks)) == text
    assert other.residual.source_roundtrip is False


def test_merge_inexact_puts_each_lost_span_in_one_chunk() -> None:
    text = "TOKENIZATION there 12+3"
    al = align(text, tokenizer("minilm"), tokenizer("t_char"))
    merged = align(text, tokenizer("minilm"), tokenizer("t_char"), merge_inexact=True)
    assert merged.n_chunks < al.n_chunks
    for start, end in merged.residual.source_lost + merged.residual.target_lost:
        if end > start:
            assert not ((merged.char_bounds > start) & (merged.char_bounds < end)).any()


def test_project_spreads_chunk_sum_over_target_tokens() -> None:
    text = "Hello"
    al = align(text, tokenizer("smollm2"), tokenizer("t_char"))  # 1 token vs 5 characters
    assert [c.kind for c in al.chunks] == ["1:n"]
    np.testing.assert_allclose(al.project([-5.0]), [-1.0] * 5)
    back = align(text, tokenizer("t_char"), tokenizer("smollm2"))
    np.testing.assert_allclose(back.project([-1.0, -2.0, -3.0, -4.0, -5.0]), [-15.0])


def test_target_without_tokens_reports_unprojectable() -> None:
    al = align("   ", tokenizer("smollm2"), tokenizer("minilm"))
    assert al.n_chunks == 1 and len(al.target) == 0
    assert al.project(np.ones(len(al.source))).shape == (0,)
    assert al.residual.unprojectable_chunks == 1


def test_align_encodings_reuses_encodings_and_matches_align() -> None:
    text = "Let's think: 415 * 336 = 139440."
    a, b = tokenizer("cl100k"), tokenizer("gemma3")
    direct = align(text, a, b)
    reused = align_encodings(text, encode(a, text), encode(b, text), source_tokenizer=a, target_tokenizer=b)
    np.testing.assert_array_equal(direct.char_bounds, reused.char_bounds)
    np.testing.assert_array_equal(direct.target_bounds, reused.target_bounds)
    with pytest.raises(ValueError, match="one source and one target encoding per text"):
        from mutualrl.thl import align_encodings_batch

        align_encodings_batch([text, text], [encode(a, text)], [encode(b, text)])


def test_lost_spans() -> None:
    assert lost_spans("abc", "abc") == ([], 0)
    assert lost_spans("Hello World", "hello world") == ([(0, 1), (6, 7)], 0)
    spans, inserted = lost_spans("a+b", "a + b")
    assert spans == [(1, 1), (2, 2)] and inserted == 2
    assert lost_spans("x€y", "x[UNK]y")[0] == [(1, 2)]


def test_pair_report_aggregates() -> None:
    texts = ["Calculate 2 + 2.", "The answer is 4.", ""]
    rep = pair_report(align_batch(texts, tokenizer("minilm"), tokenizer("smollm2")))
    assert rep.texts == 3 and rep.chars == sum(map(len, texts))
    assert rep.source_roundtrip_fail_rate == pytest.approx(2 / 3)  # capitals are lower-cased
    assert rep.target_roundtrip_fail_rate == 0.0
    assert rep.roundtrip_fail_rate == pytest.approx(2 / 3)
    assert 0.0 < rep.source_lost_char_frac < 0.1 and rep.target_lost_char_frac == 0.0
    assert rep.mean_chunk_tokens >= 1.0
    self_rep = pair_report(align_batch(texts, tokenizer("gemma3"), tokenizer("gemma3")))
    assert self_rep.non_1to1_char_frac == 0.0 and self_rep.mean_chunk_tokens == 1.0
