"""A ``zoo build --task`` file for the zoo tests: add and sub (two-digit, two terms) and one policy
``gpt2-plus`` like ``gpt2-add`` with a generalist phase, specialising in addition."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def task_file(tmp_path: Path, **entry: Any) -> Path:
    """Write the task file under ``tmp_path`` (``entry``: fields added to, or replacing, the policy's)."""
    import yaml

    ops = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "allow_parentheses": False,
           "allow_negation": False}
    cfg = {"task": {"datasets": [{"name": "basic_arithmetic", "alias": "add", "config": dict(ops, operators=["+"])},
                                 {"name": "basic_arithmetic", "alias": "sub", "config": dict(ops, operators=["-"])}],
                    "test_size": 20, "train_size": 1500},
           "zoo": [{"name": "gpt2-plus", "like": "gpt2-add", "sft_mixture": {"add": 1.0},
                    "bands": {"add": [0.35, 1.0], "sub": [0.0, 0.05]}, "generalist_target": 0.3, **entry}]}
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
