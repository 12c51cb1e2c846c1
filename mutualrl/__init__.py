"""mutualrl: Mutual Reinforcement Learning for heterogeneous language-model policies.

Several policies of different families (architectures, sizes, tokenizers) are post-trained at
the same time with GRPO and share typed experience through an exchange (SEE), a tokenizer
heterogeneity layer (THL) and a sharing strategy (PRP, XGRPO, SGT).

The package is grouped by the stage a step's data passes through (``docs/architecture.md``):
``tasks`` -> ``rollout`` -> ``exchange`` (records checked by ``experience``) -> ``thl`` ->
``algorithms`` (strategies, losses, the update); ``allocation`` places the policies, ``run``
drives the steps, ``config`` reads what the user asked for, ``export`` hands a trained policy
on, ``study`` weighs the evidence, ``zoo`` and ``realmodels`` build the models the demo uses.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__version__ = "0.1.0"

MOVED: dict[str, str] = {
    "schema": "config.schema", "resolve": "config.resolve", "modelref": "config.modelref",
    "legacy": "config.legacy", "policy": "rollout.policy", "modeling": "rollout.modeling",
    "token_tensors": "rollout.token_tensors", "engines": "rollout.engines", "trainer": "run.trainer",
    "worker": "run.worker", "worker_api": "run.worker_api", "checkpoint": "run.checkpoint",
    "resume": "run.resume", "progress": "run.progress", "tracking": "run.tracking", "faults": "run.faults",
    "distributed": "run.distributed", "fsdp": "run.fsdp", "devices": "run.devices", "quiet": "run.quiet",
    "modelcard": "export.modelcard", "hub": "export.hub", "evaluate_model": "export.evaluate_model",
    "evidence": "study.evidence", "report": "study.report",
}
"""Modules of release 0.1 that moved into the stage folders (old name -> new, under ``mutualrl.``).
The old names still import, with one ``FutureWarning``, until release 0.3 removes them (CHANGELOG)."""

REMOVED_IN = "0.3.0"


class _MovedLoader(importlib.abc.Loader):
    """Loads an old module name as the module it moved to (one object under both names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old name goes in release {REMOVED_IN}",
                      FutureWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system stamped the alias's spec on it: undo that


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        head, _, rest = fullname.partition(".")
        if head != "mutualrl" or not rest:
            return None
        first, _, tail = rest.partition(".")
        if first not in MOVED:
            return None
        new = "mutualrl." + MOVED[first] + ("." + tail if tail else "")
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new), is_package=not tail and first == "engines")


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())  # before the path finder: one module object per file
