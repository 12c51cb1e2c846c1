"""Tokenizers for the policy zoo, trained locally with the ``tokenizers`` library.

Three genuinely different algorithms, each with its own special tokens and vocabulary size:

* ``byte_bpe`` — GPT-2-style byte-level BPE (no unknown tokens possible), merges learnt on the
  task text; specials ``<|endoftext|>`` (bos = eos) and ``<|pad|>``.
* ``unigram`` — SentencePiece-style Unigram LM with the ``▁`` (Metaspace) space marker; specials
  ``<pad> <s> </s> <unk>``.
* ``char`` — one token per character (WordLevel over single characters, printable ASCII plus
  what the corpus contains); specials ``[PAD] [BOS] [EOS] [UNK]``.

In all three, every decimal digit is its own token (tiny models learn arithmetic much better that
way), the text is not normalised, ``decode(encode(text)) == text`` for text they can represent,
and ``encode`` adds no special tokens (callers append EOS to completions themselves). Encoding a
prompt and a completion separately gives the same ids as encoding their concatenation when the
prompt ends with a space (the zoo's prompt template does).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TOKENIZER_KINDS: tuple[str, ...] = ("byte_bpe", "unigram", "char")
"""The tokenizer algorithms the zoo can train."""

_PRINTABLE = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # with "\n"


@dataclass(frozen=True)
class Specials:
    """Special tokens of one tokenizer kind (``unk`` is None where nothing can be unknown)."""

    pad: str
    bos: str
    eos: str
    unk: str | None

    def as_list(self) -> list[str]:
        """Special tokens in id order (pad first, so pad id is 0, except for byte BPE)."""
        out: list[str] = []
        for tok in (self.pad, self.bos, self.eos, self.unk):
            if tok is not None and tok not in out:
                out.append(tok)
        return out


SPECIALS: dict[str, Specials] = {
    "byte_bpe": Specials(pad="<|pad|>", bos="<|endoftext|>", eos="<|endoftext|>", unk=None),
    "unigram": Specials(pad="<pad>", bos="<s>", eos="</s>", unk="<unk>"),
    "char": Specials(pad="[PAD]", bos="[BOS]", eos="[EOS]", unk="[UNK]"),
}


def _byte_bpe(texts: Sequence[str], vocab_size: int, sp: Specials) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # digits and whitespace are isolated before the GPT-2 byte-level split, so a space never fuses
    # with the next word: encode(prompt) + encode(completion) == encode(prompt + completion)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s|\d"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=sp.as_list(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _unigram(texts: Sequence[str], vocab_size: int, sp: Specials) -> Tokenizer:
    # The Unigram trainer seeds its pieces from substrings that repeat across *distinct*
    # pre-tokenized words, so it is trained on whole sentences (distinct by their numbers). Its
    # pieces are then cut the way the final pre-tokenizer cuts text (before each "▁", around
    # each digit) and every fragment keeps the best score of a piece it came from. Multi-character
    # fragments without a letter (e.g. "▁-") are dropped, so an answer's sign never fuses with the
    # space that ends the prompt.
    train_tok = Tokenizer(models.Unigram())
    train_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never",
                                                       split=False)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=sp.as_list(), unk_token=sp.unk,
        initial_alphabet=_PRINTABLE + ["▁"], max_piece_length=12, show_progress=False,
    )
    train_tok.train_from_iterator(list(texts) + ["".join(_PRINTABLE)], trainer=trainer)
    learnt = json.loads(train_tok.to_str())["model"]["vocab"]
    specials = sp.as_list()
    scores: dict[str, float] = {}
    for piece, score in learnt:
        frags = [piece] if piece in specials else _UNIGRAM_CUT.findall(piece)
        for frag in frags:
            if len(frag) > 1 and piece not in specials and not any(c.isalpha() for c in frag):
                continue
            scores[frag] = max(score, scores.get(frag, -1e9))
    vocab = [(t, 0.0) for t in specials] + [(p, s) for p, s in scores.items() if p not in specials]
    unk_id = [piece for piece, _ in vocab].index(sp.unk)
    tok = Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    tok.add_special_tokens(sp.as_list())
    return tok


def _char(texts: Sequence[str], vocab_size: int, sp: Specials) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token=sp.unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, min_frequency=0, special_tokens=sp.as_list(), show_progress=False,
    )
    tok.train_from_iterator(list(texts) + ["".join(_PRINTABLE)], trainer=trainer)
    return tok


_UNIGRAM_CUT = re.compile(r"\d|▁?[^▁\d]+|▁")

_BUILDERS = {"byte_bpe": _byte_bpe, "unigram": _unigram, "char": _char}


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a tokenizer of ``kind`` (one of :data:`TOKENIZER_KINDS`) on ``texts``.

    ``vocab_size`` is an upper bound: on a narrow corpus a trainer may stop earlier (the real
    size is ``len(tokenizer)``). Returns a ``PreTrainedTokenizerFast`` with pad/bos/eos (and unk
    where the algorithm has one) set, left padding (for batched generation) and no clean-up of
    spaces on decode, ready for ``save_pretrained``.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; valid: {', '.join(TOKENIZER_KINDS)}")
    sp = SPECIALS[kind]
    raw = _BUILDERS[kind](list(texts), vocab_size, sp)
    kwargs = {"pad_token": sp.pad, "bos_token": sp.bos, "eos_token": sp.eos}
    if sp.unk is not None:
        kwargs["unk_token"] = sp.unk
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=128, **kwargs,
    )


def tokenizer_model_type(tokenizer: PreTrainedTokenizerFast) -> str:
    """The underlying ``tokenizers`` model class name (``BPE``, ``Unigram``, ``WordLevel``...)."""
    return type(tokenizer.backend_tokenizer.model).__name__
