"""Shared bits of the benchmarks: where results go, machine description, git revision, JSON output.

A benchmark runs as ``python benchmarks/<name>.py``, so this folder is first on ``sys.path`` and
``from _common import ...`` finds this file. The machine, revision and weights helpers are the
study library's (:mod:`mutualrl.study.provenance`), so a benchmark's JSON and a study's record the
same facts the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mutualrl.study.provenance import cpu_kind, machine, weights_fingerprint, write_json
from mutualrl.study.provenance import git_rev as package_rev

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

__all__ = ["RESULTS", "cpu_kind", "git_rev", "machine", "weights_fingerprint", "write_result", "write_result_to"]


def git_rev() -> str:
    """The short commit of the checkout these benchmarks are in (``+dirty`` when ``mutualrl/`` has
    uncommitted changes), else the installed package's."""
    return package_rev(HERE)


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` atomically."""
    return write_json(RESULTS / f"{name}.json", data)


def write_result_to(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as JSON to exactly ``path`` (atomically: temporary file + rename)."""
    return write_json(path, data)


def target_points(text: str) -> float:
    """``--target`` of the sharing studies: the plan's target for the peers' share, in points (a
    positive finite number; argparse exits 2 naming the flag otherwise)."""
    import argparse

    from mutualrl.study.evidence import check_target

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        return check_target(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
