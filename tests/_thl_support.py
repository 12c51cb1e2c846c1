"""Tokenizers for the THL tests: the four real vocabularies plus four small ones trained here.

Loaded once per process (``functools.cache``), so every THL test module shares them.
"""

from __future__ import annotations

import functools

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mutualrl.thl import vocabs

REAL = ("cl100k", "minilm", "smollm2", "gemma3")
TRAINED = ("t_bpe", "t_unigram", "t_wordpiece", "t_char")


def corpus() -> list[str]:
    """Arithmetic text with some reasoning words, to train the small tokenizers on."""
    lines = []
    for i in range(400):
        a, b = (i * 37) % 997, (i * 91) % 113 - 50
        lines.append(f"Calculate {a} + {b}. First {a} + {b} = {a + b}. The answer is {a + b}.")
        lines.append(f"State the final answer: {a} * {b % 7} - {i} = {a * (b % 7) - i}")
        lines.append(f"Let's think step by step.\n({a} / {max(b, 1)}) = ? Answer: {a // max(b, 1)}")
    return lines


def _bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|eos|>"]
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def _unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], unk_token="<unk>")
    tok.train_from_iterator(corpus(), trainer)
    return tok


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"])
    tok.train_from_iterator(corpus(), trainer)
    return tok


def _char() -> Tokenizer:
    alphabet = sorted(set("".join(corpus())))
    vocab = {"[UNK]": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return tok


_BUILDERS = {"t_bpe": _bpe, "t_unigram": _unigram, "t_wordpiece": _wordpiece, "t_char": _char}


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    """A real (``vocabs``) or trained tokenizer by name, built/loaded once per process."""
    if name in REAL:
        return vocabs.load_backend(name)
    return _BUILDERS[name]()


def all_names() -> tuple[str, ...]:
    return REAL + TRAINED
