"""Shared bits of the benchmarks: machine description, git revision, JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


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
    import torch

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpu": cpu_kind(), "load_avg_1m": os.getloadavg()[0]}


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """A short SHA-256 of a model directory's weight files (names and bytes): two runs of one seed
    are paired only when they start from the same weights (a zoo build differs between CPU kinds)."""
    import hashlib

    h = hashlib.sha256()
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt"))
    for p in files:
        h.update(p.relative_to(root).as_posix().encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16] if files else "none"


def git_rev() -> str:
    """The short commit of the checkout (``+dirty`` when it has uncommitted changes), or ``unknown``."""
    for where in (Path(__file__).resolve().parent, Path.cwd()):
        try:
            rev = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=where,
                                          stderr=subprocess.DEVNULL).strip()
            dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "mutualrl"], cwd=where,
                                   stderr=subprocess.DEVNULL, check=False).returncode != 0
            return rev + ("+dirty" if dirty else "")
        except (OSError, subprocess.CalledProcessError):
            continue
    return "unknown"


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` atomically."""
    return write_result_to(RESULTS / f"{name}.json", data)


def write_result_to(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as JSON to exactly ``path`` (atomically: temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)
    return path
