"""Where a study's figures came from: the code revision, the machine, the starting weights.

A run of a study records these beside its metrics, so that a figure can be traced to the code that
trained it and two runs of one seed are paired only when they started from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import mutualrl

PACKAGE_DIR = Path(mutualrl.__file__).resolve().parent
"""The installed ``mutualrl`` package (its git checkout, for an editable install)."""


def cpu_kind() -> dict[str, Any]:
    """The CPU's model name and the vector flags that change float results and speed (machines of one
    kind differ: an AMD EPYC with AVX2 only, one with AVX-512 and bf16, an Intel Xeon with AMX)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": platform.processor() or "unknown", "flags": []}
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    return {"model": model, "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})}


def machine() -> dict[str, Any]:
    """CPU count, torch threads, Python and torch versions, platform, CPU kind and the 1-minute load."""
    import torch

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpu": cpu_kind(), "load_avg_1m": os.getloadavg()[0]}


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """A short SHA-256 of a model directory's weight files (names and bytes): two runs of one seed
    are paired only when they start from the same weights (a zoo build differs between CPU kinds)."""
    h = hashlib.sha256()
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt"))
    for p in files:
        h.update(p.relative_to(root).as_posix().encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16] if files else "none"


def _git(args: list[str], where: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, check=False)


def git_rev(*where: Path) -> str:
    """The short commit of the checkout that holds ``mutualrl`` (``+dirty`` when the package has
    uncommitted changes). ``where``: folders to ask first (a benchmark's own checkout); the package's
    folder is asked last, and counts only when git tracks the package there (not a virtual
    environment inside another project). Without a checkout: ``mutualrl <version>``."""
    for folder in (*where, PACKAGE_DIR):
        try:
            head = _git(["rev-parse", "--short", "HEAD"], folder)
            if head.returncode != 0:
                continue
            if folder == PACKAGE_DIR and _git(["ls-files", "--error-unmatch", "__init__.py"], folder).returncode:
                continue
            dirty = _git(["diff", "--quiet", "HEAD", "--", ":(top)mutualrl"], folder).returncode != 0
        except OSError:  # no git on this machine
            break
        return head.stdout.strip() + ("+dirty" if dirty else "")
    return f"mutualrl {mutualrl.__version__}"


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file renamed over it): a study
    stopped while writing leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)
    return path
