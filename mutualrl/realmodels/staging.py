"""Writing into the cache safely: a staging directory renamed into place, stale leftovers swept."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mutualrl.realmodels.specs import _FORMAT, MANIFEST


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _complete(directory: Path) -> bool:
    manifest = _read_manifest(directory)
    return manifest is not None and manifest.get("format") == _FORMAT
