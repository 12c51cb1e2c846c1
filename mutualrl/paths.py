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
