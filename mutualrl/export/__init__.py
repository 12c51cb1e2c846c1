"""Handing a trained policy on: a Hugging Face model folder with its model card, an upload to the
Hub, and the evaluation of an exported model on a task."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    """The names of release 0.1's ``mutualrl.export`` module, now in :mod:`mutualrl.export.model`."""
    model = importlib.import_module("mutualrl.export.model")
    if name.startswith("__") or not hasattr(model, name):
        raise AttributeError(f"module 'mutualrl.export' has no attribute {name!r}")
    warnings.warn(f"mutualrl.export.{name} moved to mutualrl.export.model.{name}; the old name goes in "
                  "release 0.3.0", FutureWarning, stacklevel=2)
    return getattr(model, name)
