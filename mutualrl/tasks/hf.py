"""Hugging Face ``datasets`` as a task source: a hub id, a ``save_to_disk`` directory or a ``Dataset``.

A hub id is loaded with ``datasets.load_dataset`` (it needs the network the first time; nothing in
the tests or the demo does that); a directory written by ``save_to_disk`` with
``datasets.load_from_disk``; a ``Dataset`` or ``DatasetDict`` object is taken as it is (the Python
API: ``MutualTrainer(config, train_dataset=ds)``). ``split`` names the training split of a
``DatasetDict``; the test split is the dataset's own ``test_split`` when given, else a held-out
``test_fraction`` of the training rows (:class:`~mutualrl.tasks.rows.RowSource`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mutualrl.tasks.rows import RowSource, SourceFieldError


def _require_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise SourceFieldError("dataset", "Hugging Face datasets need the datasets package: pip install datasets "
                               "(or mutualrl[data])") from None
    return datasets


def load_splits(dataset: Any, split: str, test_split: str | None) -> tuple[list[dict], list[dict] | None]:
    """(training rows, test rows or None) of a dataset given as a hub id, a directory or an object."""
    ds = _require_datasets()
    if isinstance(dataset, str):
        path = Path(dataset).expanduser()
        if path.exists():
            if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
                raise SourceFieldError("dataset", f"{dataset!r} is not a directory written by save_to_disk "
                                       "(no dataset_info.json or dataset_dict.json)")
            try:
                obj = ds.load_from_disk(str(path))
            except Exception as exc:  # noqa: BLE001 - a damaged directory: say which
                raise SourceFieldError("dataset", f"cannot read the dataset directory {dataset!r}: "
                                       f"{type(exc).__name__}: {exc}") from None
        else:
            try:
                obj = ds.load_dataset(dataset)
            except Exception as exc:  # noqa: BLE001 - the hub, the network, the id: one message
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise SourceFieldError("dataset", f"cannot load {dataset!r} as a local directory or a hub "
                                       f"dataset ({first})") from None
    else:
        obj = dataset
    if isinstance(obj, ds.DatasetDict):
        splits = list(obj.keys())
        if split not in obj:
            raise SourceFieldError("split", f"no split {split!r} in the dataset (splits: {', '.join(splits)})")
        if test_split is not None and test_split not in obj:
            raise SourceFieldError("test_split", f"no split {test_split!r} in the dataset (splits: "
                                   f"{', '.join(splits)})")
        return (_rows(obj[split], "split", split),
                _rows(obj[test_split], "test_split", test_split) if test_split is not None else None)
    if isinstance(obj, ds.Dataset):
        if test_split is not None:
            raise SourceFieldError("test_split", "the dataset has a single split; leave test_split out (a held-out "
                                   "test_fraction is used) or give a DatasetDict")
        return _rows(obj, "split", split), None
    raise SourceFieldError("dataset", f"expected a hub id, a save_to_disk directory or a datasets.Dataset, got "
                           f"{type(obj).__name__}")


def _rows(split: Any, field: str, name: str) -> list[dict]:
    """A split's rows as dicts; an empty split is refused naming its field."""
    if not len(split):
        raise SourceFieldError(field, f"split {name!r} of the dataset is empty")
    return split.to_list()


class DatasetSource(RowSource):
    """Problems from a Hugging Face dataset (see the module docstring and :class:`RowSource`)."""

    def __init__(self, dataset: Any, name: str | None = None, *, split: str = "train", test_split: str | None = None,
                 question_field: str | None = None, answer_field: str | None = None, answer_extractor: str = "raw",
                 verifier: str = "exact", test_fraction: float = 0.2) -> None:
        train, test = load_splits(dataset, split, test_split)
        default = Path(dataset).name if isinstance(dataset, str) else "dataset"
        super().__init__(name or default.replace("/", "_"), train, question_field=question_field,
                         answer_field=answer_field, answer_extractor=answer_extractor, verifier=verifier,
                         test_fraction=test_fraction, test_rows=test)
