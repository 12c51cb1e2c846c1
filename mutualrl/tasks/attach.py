"""The Python API's data and rewards, as TRL takes them, turned into an ordinary run config.

``MutualTrainer(config, train_dataset=ds, reward_funcs=[f])`` ends up exactly where the file route
does: the dataset is written once with ``save_to_disk`` under the cache (keyed by its fingerprint,
so a second run reuses it) and named in ``task.datasets``; each reward function is named by its
import path, so worker processes and Ray actors import it like one given in YAML. A function no
other process can import (a lambda, a closure, one defined in the ``__main__`` script) is kept in
this process and needs ``scheduler: sequential``; asking for more is refused naming it.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mutualrl.config import RunConfig, read_config_data
from mutualrl.errors import ConfigError
from mutualrl.paths import cache_root
from mutualrl.tasks.rewards import RewardFn, register_in_process, reward_function_path

DATA_OPTIONS = ("alias", "weight", "question_field", "answer_field", "answer_extractor", "verifier", "test_fraction")
"""Options of a ``task.datasets`` entry that stay meaningful for a dataset passed in Python."""
STALE_TMP_S = 3600.0
"""A half-written copy older than this (its writer was killed) is removed by the next writer."""


def saved_dataset(train: Any, test: Any | None = None) -> tuple[str, str | None]:
    """(directory, test split name or None) of ``train`` (and ``test``) written with ``save_to_disk``
    under the cache, by content fingerprint (an existing copy is reused)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("train_dataset", "needs the datasets package: pip install datasets (or mutualrl[data])") \
            from None
    if not isinstance(train, (datasets.Dataset, datasets.DatasetDict)):
        raise ConfigError("train_dataset", f"expected a datasets.Dataset or DatasetDict, got {type(train).__name__}")
    if test is not None and not isinstance(test, datasets.Dataset):
        raise ConfigError("eval_dataset", f"expected a datasets.Dataset, got {type(test).__name__}")
    if isinstance(train, datasets.DatasetDict):
        if "train" not in train:
            raise ConfigError("train_dataset", f"a DatasetDict needs a 'train' split (splits: {', '.join(train)})")
        parts = dict(train)
    else:
        parts = {"train": train}
    if test is not None:
        parts["test"] = test
    for name, part in parts.items():
        if not len(part):
            raise ConfigError("eval_dataset" if name == "test" else "train_dataset", f"split {name!r} is empty")
    obj = datasets.DatasetDict(parts)
    key = "-".join(f"{name}-{getattr(ds, '_fingerprint', '')}" for name, ds in sorted(obj.items()))
    d = cache_root("datasets") / key
    _save_once(obj, d)
    return str(d), ("test" if "test" in obj else None)


def _save_once(obj: Any, d: Path) -> None:
    """Write ``obj`` to ``d`` with ``save_to_disk`` unless a complete copy is there.

    The copy is written to a private temporary sibling and renamed into place, so a reader never
    sees half a dataset, two processes writing the same key do not collide (the second keeps the
    first's copy), and a copy left behind by a killed writer — a partial ``d`` without its
    ``dataset_dict.json``, or a temporary sibling older than :data:`STALE_TMP_S` — is removed."""
    if (d / "dataset_dict.json").is_file():
        return
    d.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in d.parent.glob(f"{d.name}.*.tmp"):
        try:
            if now - old.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # another writer removed or renamed it
    tmp = Path(tempfile.mkdtemp(prefix=f"{d.name}.", suffix=".tmp", dir=d.parent))
    try:
        obj.save_to_disk(str(tmp))
        if d.exists() and not (d / "dataset_dict.json").is_file():
            shutil.rmtree(d, ignore_errors=True)
        try:
            tmp.rename(d)
        except OSError:
            if not (d / "dataset_dict.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def attach(config: str | Mapping[str, Any] | RunConfig, train_dataset: Any | None = None,
           eval_dataset: Any | None = None, reward_funcs: Sequence[RewardFn | str] = ()) -> dict[str, Any]:
    """The run config ``config`` with ``train_dataset`` (and ``eval_dataset``) as its task data and
    ``reward_funcs`` added to its reward functions (see the module docstring)."""
    data = copy.deepcopy(config.to_dict() if isinstance(config, RunConfig) else dict(read_config_data(
        config if not isinstance(config, Mapping) else dict(config))))
    task = data.setdefault("task", {}) or {}
    data["task"] = task
    if train_dataset is not None:
        entries = task.get("datasets") or []
        if task.get("preset") is not None or len(entries) > 1 or (
                entries and any(entries[0].get(k) is not None for k in ("name", "path", "dataset"))):
            raise ConfigError("task.datasets", "train_dataset is the task's data: leave task.datasets (and "
                              "task.preset) out, or give one entry with only its options "
                              f"({', '.join(DATA_OPTIONS)})")
        entry = dict(entries[0]) if entries else {}
        directory, test_split = saved_dataset(train_dataset, eval_dataset)
        entry.update(dataset=directory, split="train", test_split=test_split)
        entry.setdefault("alias", "train")
        task["datasets"] = [entry]
    elif eval_dataset is not None:
        raise ConfigError("eval_dataset", "give train_dataset with it")
    paths = list(task.get("reward_functions") or [])
    sequential = data.get("scheduler", "sequential") == "sequential"
    for i, fn in enumerate(reward_funcs):
        if isinstance(fn, str):
            paths.append(fn)
            continue
        if not callable(fn):
            raise ConfigError(f"reward_funcs[{i}]", f"expected a function or an import path, got {type(fn).__name__}")
        path = reward_function_path(fn)
        if path is None:
            if not sequential:
                raise ConfigError(f"reward_funcs[{i}]", f"{getattr(fn, '__qualname__', fn)!r} cannot be imported by "
                                  f"the worker processes of scheduler: {data.get('scheduler')}: define it at the top "
                                  "level of an importable module, or use scheduler: sequential")
            path = register_in_process(fn)
        paths.append(path)
    task["reward_functions"] = paths
    return data
