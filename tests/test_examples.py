"""Every shipped example config is valid (the README and docs point users at them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mutualrl.resolve import load_config

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_loads(path):
    cfg = load_config(str(path), check_paths=False)  # models are resolved at run time
    assert cfg.policies and cfg.steps > 0


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
