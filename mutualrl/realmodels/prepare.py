"""Preparing a real model once: a safetensors Hugging Face directory (model, tokenizer) in the cache."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mutualrl.errors import UserError
from mutualrl.paths import cache_root
from mutualrl.realmodels.gguf import gguf_path
from mutualrl.realmodels.specs import _FORMAT, MANIFEST, PRESETS, _spec
from mutualrl.realmodels.staging import _complete, _staging
from mutualrl.run.quiet import quiet_transformers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# ----------------------------------------------------------------------------- cache directories


def prepared_dir(name: str) -> Path:
    """Where the prepared safetensors directory of ``name`` lives (whether or not it exists)."""
    return cache_root() / "real" / f"{_spec(name).name}-hf"


def _tokenizer_dir(name: str) -> Path:
    return cache_root() / "real" / f"{_spec(name).name}-tokenizer"


def is_prepared(name: str) -> bool:
    """True when ``name`` has a complete prepared directory in the cache."""
    return _complete(prepared_dir(name))


def _require_gguf_deps() -> None:
    missing = []
    for mod in ("gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise UserError(
            f"loading GGUF models needs {', '.join(missing)}; install with: pip install gguf accelerate"
        )


def _load_gguf_tokenizer(name: str) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    _require_gguf_deps()
    path = gguf_path(name)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(tok, "chat_template", None) and _spec(name).chat_template:
        tok.chat_template = _spec(name).chat_template
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def real_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """Load only the fast tokenizer of ``name`` (with its chat template).

    Uses the prepared directory when present, else a tokenizer-only cache dir, which is created
    on first use by extracting the tokenizer from the GGUF (seconds, not the whole model).
    """
    from transformers import AutoTokenizer

    for directory in (prepared_dir(name), _tokenizer_dir(name)):
        if _complete(directory):
            return AutoTokenizer.from_pretrained(str(directory))
    tok = _load_gguf_tokenizer(name)
    with _staging(_tokenizer_dir(name)) as tmp:
        tok.save_pretrained(str(tmp))
        _write_manifest(tmp, {"name": name, "kind": "tokenizer", **_tokenizer_facts(tok)})
    return tok


def _tokenizer_facts(tok: Any) -> dict[str, Any]:
    spec = json.loads(tok.backend_tokenizer.to_str())
    algo = spec["model"].get("type", "?")
    if "ByteLevel" in json.dumps(spec.get("pre_tokenizer")):
        algo = f"byte-level {algo}"
    elif spec["model"].get("byte_fallback"):
        algo = f"SentencePiece-style {algo} (byte fallback)"
    return {
        "tokenizer_algorithm": algo,
        "tokenizer_class": type(tok).__name__,
        "vocab_size": len(tok),
        "has_chat_template": bool(getattr(tok, "chat_template", None)),
    }


def _write_manifest(directory: Path, facts: dict[str, Any]) -> None:
    facts = {"format": _FORMAT, **facts}
    (directory / MANIFEST).write_text(json.dumps(facts, indent=2) + "\n")


# ----------------------------------------------------------------------------- preparing


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.fields[model]}[/]"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} {task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


def _prepare_into(name: str, tmp: Path, step: Callable[[str], None]) -> dict[str, Any]:
    """Dequantize ``name``'s GGUF and save model + tokenizer into ``tmp``; return manifest facts."""
    from transformers import AutoModelForCausalLM

    spec = _spec(name)
    step("locating GGUF")
    path = gguf_path(name)
    step("loading tokenizer")
    tok = real_tokenizer(name)
    step("dequantizing weights")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    for holder in (model.config, getattr(model, "generation_config", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.hf_quantizer = None
    model.is_quantized = False
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    eos = [tok.eos_token_id] + [
        tok.convert_tokens_to_ids(t) for t in spec.extra_eos_tokens if t in tok.get_vocab()
    ]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    model.generation_config.pad_token_id = tok.pad_token_id
    step("saving safetensors")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    return {
        "name": name,
        "kind": "model",
        "title": spec.title,
        "family": spec.family,
        "model_type": model.config.model_type,
        "source_package": f"{spec.distribution}=={spec.version}",
        "gguf": path.name,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
        **_tokenizer_facts(tok),
    }


def prepare(name: str, progress: bool = True) -> Path:
    """Prepare ``name`` once (GGUF -> safetensors HF dir in the cache) and return that directory.

    Idempotent: returns at once when the directory is already complete. The directory appears
    under its final name only after everything was written (temp dir + rename).
    """
    final = prepared_dir(name)
    if _complete(final):
        return final
    _require_gguf_deps()
    gguf_path(name)  # fail fast with the pip hint before starting a progress bar
    steps = 5
    start = time.perf_counter()
    with quiet_transformers(), _progress(progress) as bar, _staging(final) as tmp:
        task = bar.add_task("", total=steps, model=name)
        count = 0

        def step(desc: str) -> None:
            nonlocal count
            bar.update(task, completed=count, description=desc)
            count += 1

        facts = _prepare_into(name, tmp, step)
        step("done")
        facts["prepare_seconds"] = round(time.perf_counter() - start, 1)
        _write_manifest(tmp, facts)
        bar.update(task, completed=steps)
    return final


def prepare_preset(preset: str, progress: bool = True) -> dict[str, Path]:
    """Prepare every model of ``preset`` (e.g. ``real-small``); return ``{name: directory}``."""
    return {name: prepare(name, progress=progress) for name in _preset_names(preset)}


def _preset_names(preset: str) -> list[str]:
    try:
        return PRESETS[preset]
    except KeyError:
        raise UserError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}") from None


def preset_model_dirs(preset: str) -> dict[str, Path]:
    """``{name: prepared directory}`` for a preset, preparing missing models on demand."""
    return prepare_preset(preset, progress=sys.stderr.isatty())
