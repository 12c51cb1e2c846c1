"""The two passes of ``./run tests`` (tests/conftest.py): SERIAL names what exists, and the parallel
pass refuses a test that starts a Python process (it belongs to SERIAL)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import conftest
import pytest


def test_a_python_process_started_in_the_parallel_pass_names_serial(monkeypatch):
    if conftest.PASS != "parallel":
        pytest.skip("the guard is on in the parallel pass of ./run tests only (MUTUALRL_TEST_PASS=parallel)")
    with pytest.raises(RuntimeError, match=r"test_suite_passes\.py.*add it to SERIAL in tests/conftest\.py"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(RuntimeError, match="a multiprocessing child"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    assert subprocess.run(["true"], check=True).returncode == 0  # other commands run


def test_every_serial_entry_names_an_existing_module_or_test():
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for entry in conftest.SERIAL:
        module, _, test = entry.partition("::")
        assert (here / module).is_file(), entry
        if test:
            assert f"def {test}(" in (here / module).read_text(), entry
