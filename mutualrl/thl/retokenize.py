"""Retokenize text for any Hugging Face tokenizer: token ids plus character offsets.

Three kinds of tokenizer are accepted:

* a ``tokenizers.Tokenizer`` (the Rust backend) -- offsets come from its offset mapping;
* a ``transformers`` fast tokenizer -- its backend tokenizer is used the same way;
* anything else with ``encode(text)`` and ``decode(ids)`` (a slow ``transformers`` tokenizer, a
  ``tiktoken.Encoding``, ...) -- offsets are recovered by incremental decoding.

Offsets are half-open ``(start, end)`` character ranges into the text. Special tokens are never
added implicitly: alignment works on the text's own tokens only (``add_special_tokens=False``).
BOS, chat templates and EOS are added explicitly with :func:`encode_prompt` and
:func:`encode_completion`, which retokenizes a completion *as a completion*: in the context of
the learner's own prompt encoding, so that no dummy-prefix space or cross-boundary merge leaks in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

__all__ = [
    "Encoded",
    "backend_of",
    "decode",
    "encode",
    "encode_batch",
    "encode_completion",
    "encode_prompt",
    "offsets_by_decoding",
]

#: How many characters of prompt context are re-encoded in front of a completion.
_CONTEXT_CHARS = 32


@dataclass(frozen=True, slots=True)
class Encoded:
    """One text's tokenization: ``ids[i]`` covers ``text[offsets[i][0]:offsets[i][1]]``."""

    text: str
    ids: Sequence[int]
    offsets: Sequence[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.ids)


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


# id(original) -> (original, copy without padding/truncation); the original is kept alive so the id stays valid
_UNPADDED: dict[int, tuple[Tokenizer, Tokenizer]] = {}


def _unpadded(backend: Tokenizer) -> Tokenizer:
    if backend.padding is None and backend.truncation is None:
        return backend
    hit = _UNPADDED.get(id(backend))
    if hit is None or hit[0] is not backend:
        copy = Tokenizer.from_str(backend.to_str())
        copy.no_padding()
        copy.no_truncation()
        hit = _UNPADDED[id(backend)] = (backend, copy)
    return hit[1]


def backend_of(tokenizer: Any) -> Tokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` behind ``tokenizer``, or ``None`` if it has none.

    A backend configured to pad or truncate is replaced by a copy that does neither (alignment
    needs exactly the text's tokens); the caller's tokenizer is left unchanged.
    """
    if isinstance(tokenizer, Tokenizer):
        return _unpadded(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return _unpadded(backend) if isinstance(backend, Tokenizer) else None


def _check_decodable(tokenizer: Any) -> None:
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(
            f"{type(tokenizer).__name__} is not a usable tokenizer: expected a tokenizers.Tokenizer, a "
            "transformers fast tokenizer (offset mapping), or an object with encode(text) and decode(ids)"
        )


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Decode ``ids`` to text exactly as the tokenizer does, keeping special tokens, no clean-up."""
    backend = backend_of(tokenizer)
    if backend is not None:
        return backend.decode(list(ids), skip_special_tokens=False)
    _check_decodable(tokenizer)
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except TypeError:  # e.g. tiktoken.Encoding.decode(ids) takes no such keywords
        return tokenizer.decode(list(ids))


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for a tokenizer without offsets."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # tiktoken: encode(text, allowed_special=..., disallowed_special=...)
        return list(tokenizer.encode(text, disallowed_special=()))


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first mismatch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def offsets_by_decoding(tokenizer: Any, ids: Sequence[int], text: str) -> list[tuple[int, int]]:
    """Character offsets of ``ids`` in ``text`` recovered by decoding growing prefixes.

    Token ``i`` ends where ``decode(ids[:i+1])`` (without a trailing partial character, shown as
    U+FFFD) stops agreeing with ``text``. Tokens that add no complete character get a zero-width
    span; a suffix the decoding never reproduces (a normaliser changed it) goes to the last token.
    Quadratic in the number of tokens; use a fast tokenizer where you can.
    """
    offsets: list[tuple[int, int]] = []
    prev = 0
    for i in range(len(ids)):
        piece = decode(tokenizer, ids[: i + 1]).rstrip("\ufffd")
        end = max(prev, _common_prefix_len(piece, text))
        offsets.append((prev, end))
        prev = end
    if offsets and prev < len(text):
        offsets[-1] = (offsets[-1][0], len(text))
    return offsets


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> Encoded:
    """Token ids and character offsets of ``text``.

    With ``add_special_tokens=True`` the tokenizer's post-processor adds its specials (BOS, ...)
    with zero-width offsets; alignment expects the default ``False``.
    """
    _check_text(text)
    backend = backend_of(tokenizer)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=add_special_tokens)
        return Encoded(text, enc.ids, enc.offsets)
    _check_decodable(tokenizer)
    if add_special_tokens:
        ids = list(tokenizer.encode(text))
    else:
        ids = _plain_ids(tokenizer, text)
    return Encoded(text, ids, offsets_by_decoding(tokenizer, ids, text))


def encode_batch(tokenizer: Any, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[Encoded]:
    """:func:`encode` for many texts; uses the backend's parallel batch encoder when there is one."""
    for text in texts:
        _check_text(text)
    backend = backend_of(tokenizer)
    if backend is None:
        return [encode(tokenizer, t, add_special_tokens=add_special_tokens) for t in texts]
    encs = backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [Encoded(t, e.ids, e.offsets) for t, e in zip(texts, encs)]


def _special_id(tokenizer: Any, which: str) -> int | None:
    value = getattr(tokenizer, f"{which}_token_id", None)
    return int(value) if isinstance(value, int) else None


def encode_prompt(
    tokenizer: Any,
    prompt: str | Sequence[dict[str, str]],
    *,
    add_bos: bool = True,
) -> list[int]:
    """The learner's own prompt ids.

    A list of chat messages is rendered with the tokenizer's chat template (generation prompt
    appended; the template decides about BOS). A plain string is encoded as text, with the BOS
    token (if the tokenizer has one and ``add_bos``) put in front explicitly.
    """
    if not isinstance(prompt, str):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template; pass the prompt as a string instead"
            )
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    ids = list(encode(tokenizer, prompt).ids)
    bos = _special_id(tokenizer, "bos")
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def _clean_cut(offsets: Sequence[tuple[int, int]], at: int) -> int | None:
    """Index of the first token starting at or after ``at``; ``None`` if a token straddles ``at``."""
    for i, (start, end) in enumerate(offsets):
        if start >= at:
            return i
        if end > at:
            return None
    return len(offsets)


def encode_completion(
    tokenizer: Any,
    prompt: str | Sequence[int],
    completion: str,
    *,
    add_eos: bool = False,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Retokenize ``completion`` as it follows the learner's prompt.

    ``prompt`` is the learner's prompt, as text or as the ids it was actually fed (e.g. from
    :func:`encode_prompt` with a chat template; they are decoded to get the context). The last
    few characters of the prompt are encoded together with the completion and the completion's
    tokens are taken from the first clean token boundary at the junction, so a SentencePiece
    dummy prefix or a merge with a prompt-less start cannot appear. If the junction is not a
    clean boundary (a token would straddle it), the completion is encoded on its own.

    Returns ``(ids, offsets)`` with offsets relative to ``completion``; with ``add_eos`` the EOS
    id is appended with the zero-width offset ``(len(completion), len(completion))``.
    """
    _check_text(completion)
    if isinstance(prompt, str):
        context = prompt
    else:
        context = decode(tokenizer, [int(i) for i in prompt])
    context = context[-_CONTEXT_CHARS:]
    ids: list[int]
    offsets: list[tuple[int, int]]
    if context and completion:
        enc = encode(tokenizer, context + completion)
        cut = _clean_cut(enc.offsets, len(context))
        if cut is not None:
            k = len(context)
            ids = list(enc.ids[cut:])
            offsets = [(max(s - k, 0), max(e - k, 0)) for s, e in enc.offsets[cut:]]
        else:
            enc = encode(tokenizer, completion)
            ids, offsets = list(enc.ids), list(enc.offsets)
    else:
        enc = encode(tokenizer, completion)
        ids, offsets = list(enc.ids), list(enc.offsets)
    if add_eos:
        eos = _special_id(tokenizer, "eos")
        if eos is None:
            raise ValueError(f"{type(tokenizer).__name__} has no eos_token_id; cannot add_eos")
        ids.append(eos)
        offsets.append((len(completion), len(completion)))
    return ids, offsets
