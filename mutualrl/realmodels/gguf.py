"""Locating, assembling and verifying the GGUF files that PyPI wheels ship."""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from importlib import metadata
from pathlib import Path

from mutualrl.errors import UserError
from mutualrl.paths import cache_root
from mutualrl.realmodels.specs import RealModel, _spec
from mutualrl.realmodels.staging import _sweep_stale, _umask

# ----------------------------------------------------------------------------- locating GGUFs


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

