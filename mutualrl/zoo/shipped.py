"""The default zoo policies as built once and shipped with the package, checked by hash on load.

A zoo build is deterministic on one CPU, but floating-point rounding differs between CPUs (three
variants of the same machine kind gave three different zoos, and on one the warm start never
landed), so the default policies are not rebuilt on each machine: ``mutualrl/zoo/shipped/<name>``
holds the built directory (weights, tokenizer, card) and ``MANIFEST.json`` the sha256 of every
file and the cache key of the spec they were built from (build seed 0, the zoo task; ``built_with``
names a field the default spec has changed since, with the value the shipped build used). Any other
seed, spec or task is built locally (:func:`mutualrl.zoo.build.build_zoo`); ``mutualrl zoo build
--rebuild`` builds the default ones on this machine instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from mutualrl.errors import UserError

SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped"
MANIFEST = SHIPPED_ROOT / "MANIFEST.json"


class ShippedWeightsError(UserError):
    """Shipped zoo files that are missing or do not match their recorded hash."""


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.cache
def manifest() -> dict[str, Any]:
    """The shipped policies: ``{name: {"cache_key", "files": {file: sha256}, ...}}`` (empty when none)."""
    if not MANIFEST.is_file():
        return {}
    return json.loads(MANIFEST.read_text(encoding="utf-8"))["policies"]


def shipped_key(name: str) -> str | None:
    """The spec cache key the shipped ``name`` was built from (None when it is not shipped)."""
    entry = manifest().get(name)
    return entry["cache_key"] if entry else None


def shipped_version(name: str) -> str | None:
    """The :data:`~mutualrl.zoo.specs.ZOO_VERSION` the shipped ``name`` was built under (its cache key
    was computed with it; None when it is not shipped)."""
    entry = manifest().get(name)
    return entry["zoo_version"] if entry else None


def shipped_built_with(name: str) -> dict[str, Any]:
    """Spec fields whose value for the shipped ``name`` differs from today's default spec, with the
    value it was built with (``{}`` when none, or when it is not shipped): the recipe changed after
    it was built for other build seeds, and the shipped build still stands for build seed 0."""
    entry = manifest().get(name)
    return dict(entry.get("built_with", {})) if entry else {}


@functools.cache
def verified_dir(name: str) -> Path:
    """The shipped directory of ``name`` after checking every file against the manifest (once per
    process); raises :class:`ShippedWeightsError` naming the first file that is missing or differs."""
    entry = manifest()[name]
    d = SHIPPED_ROOT / name
    for fname, digest in sorted(entry["files"].items()):
        p = d / fname
        if not p.is_file():
            raise ShippedWeightsError(f"shipped zoo policy {name!r}: {p} is missing; reinstall mutualrl, or build "
                                      f"it on this machine with `mutualrl zoo build --rebuild --names {name}`")
        got = file_sha256(p)
        if got != digest:
            raise ShippedWeightsError(f"shipped zoo policy {name!r}: {p} has sha256 {got[:16]}…, the manifest "
                                      f"says {digest[:16]}…; reinstall mutualrl, or build it on this machine "
                                      f"with `mutualrl zoo build --rebuild --names {name}`")
    return d
