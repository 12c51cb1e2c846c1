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


def machine() -> dict[str, Any]:
    import torch

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]}


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
