"""Where mutualrl keeps what it builds or converts once: one cache root for everything."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(sub: str | None = None) -> Path:
    """``$MUTUALRL_CACHE`` (``~`` expanded) or ``~/.cache/mutualrl``; ``sub`` names a folder in it
    (``zoo``, ``real``, ``gguf``, ``tokenizers``)."""
    env = os.environ.get("MUTUALRL_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "mutualrl"
    return root / sub if sub else root


# the files of a run directory (written by the trainer, read by resume, eval, report and benchmarks)
RUN_CONFIG = "config.yaml"
"""The resolved config the run trains with (``mutualrl train --resume`` reads it back)."""
METRICS = "metrics.jsonl"
"""One JSON line per policy per step, and per evaluation."""
SUMMARY = "summary.json"
"""Initial, final and best held-out accuracy per policy, and the wall time."""
POLICIES_INFO = "policies.json"
"""What each worker runs (sizes, tokenizer, device, engine), written at the start."""
