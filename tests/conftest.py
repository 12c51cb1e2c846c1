"""Shared fixtures: tiny heterogeneous models built once per test session (no downloads)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mutualrl.zoo import build_tiny_models  # after the offline switch above

if TYPE_CHECKING:
    from mutualrl.tasks import Task

RAY = ("test_data_parallel.py", "test_exchange_hostile.py", "test_exchange_ray.py", "test_scheduler_contract.py")
"""The modules whose tests share the session's Ray (``shared_ray``): run one after the other, so that
Ray starts once for them and is stopped once the last of them is done."""

SERIAL = {
    # modules whose tests start worker or rank processes, Ray or vLLM, kill processes or wait on timeouts
    *RAY, "test_allocation_local.py", "test_allocation_ray_multinode.py", "test_exchange_sqlite_procs.py",
    "test_faults.py", "test_realmodels.py", "test_study_cli.py", "test_vllm_engine.py", "test_vllm_real_lengths.py",
    "test_zoo.py", "test_zoo_child.py",
    "test_export.py", "test_eval_model.py",  # vLLM in this process; they share trained_zoo_run, built once
    # single tests of other modules (module.py::test)
    "test_strategy_shape.py::test_user_steps_register_in_worker_processes_through_sharing_modules",
    "test_study_memory.py::test_a_process_trees_resident_bytes_count_its_children",
}
"""What ``./run tests`` runs in its second pass, one test at a time: the tests that start processes
(the local scheduler's workers, ranks, zoo builders), Ray or vLLM, or that wait on a timeout. Its first
pass runs the rest on two pytest-xdist workers: they run in this process and write only under their
``tmp_path``. Measured on 2 cores, two such process-starting tests at once take longer than one after
the other, and a Ray start next to vLLM missed its 60 s deadline; a new test that starts processes,
Ray or vLLM belongs here."""

PASS = os.environ.get("MUTUALRL_TEST_PASS", "")
"""``parallel`` or ``serial`` (set by ``./run tests``): only that pass's tests are collected and run;
unset (plain ``pytest``), all of them."""


def _serial(item: pytest.Item) -> bool:
    name = item.path.name
    return name in SERIAL or f"{name}::{getattr(item, 'originalname', item.name)}" in SERIAL


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A pass does not import the modules it runs nothing of (every xdist worker collects)."""
    name = collection_path.name
    if not PASS or not (name.startswith("test_") and name.endswith(".py")):
        return None
    some_serial = name in SERIAL or any(k.startswith(f"{name}::") for k in SERIAL)
    if (PASS == "parallel" and name in SERIAL) or (PASS == "serial" and not some_serial):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PASS:  # the tests of the other pass are deselected
        other = [it for it in items if _serial(it) != (PASS == "serial")]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [it for it in items if _serial(it) == (PASS == "serial")]
    ray_items = [it for it in items if it.path.name in RAY]
    if ray_items:  # the modules of RAY together, where the first of them was
        first = items.index(ray_items[0])
        rest = [it for it in items if it.path.name not in RAY]
        items[:] = rest[:first] + ray_items + rest[first:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last test of the RAY modules (and the fixtures it leaves), the shared Ray stops."""
    result = yield
    if item.path.name in RAY and (nextitem is None or nextitem.path.name not in RAY) and "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    return result


@pytest.fixture(autouse=True)
def _no_process_in_the_parallel_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """In the parallel pass a test that starts a Python process (a worker, a rank, Ray's helpers) or a
    multiprocessing child fails, naming SERIAL: such a test belongs to the serial pass (two of them at
    once on 2 cores miss their timeouts). Other commands (git, lscpu) are fine."""
    if PASS != "parallel":
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(what: str) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts {what} in the parallel pass of ./run tests: add it to "
                           "SERIAL in tests/conftest.py")

    popen_init = subprocess.Popen.__init__

    def guarded_init(self, args, *a, **k):
        first = args if isinstance(args, str | bytes | os.PathLike) else (list(args) or [""])[0]
        program = (os.path.basename(os.fsdecode(first)).split() or [""])[0]
        if program.startswith("python") or first == sys.executable:
            refuse(f"a Python process ({os.fsdecode(first)})")
        popen_init(self, args, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: refuse("a multiprocessing child"))
    yield


@pytest.fixture(scope="session")
def shared_ray():
    """``shared_ray()``: this process connected to the local Ray that the tests of the RAY modules share
    (a start costs ~8 s on 2 cores), started at the first call (again after a test that stopped it to
    start a Ray of its own) and stopped after the last of those modules. Its workers have tests/ on
    PYTHONPATH (they import the reward functions of tests/test_trainer.py). Users leave it up and kill
    what they start; a scheduler that finds Ray running leaves it running."""
    ray = pytest.importorskip("ray")

    def up():
        if not ray.is_initialized():
            with pytest.MonkeyPatch.context() as mp:  # the raylet, and so every worker, inherits it
                mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                                      os.environ.get("PYTHONPATH")])))
                ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        return ray

    yield up
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    tiny models run fastest on one and keep timings stable on a shared machine; the count is restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def small_zoo_task() -> Task:
    """The zoo's default task with 200 training and 20 test problems (read-only for its users)."""
    from mutualrl.zoo import default_task

    return default_task(test_size=20, train_size=200)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two untrained tiny causal LMs of different families and tokenizer algorithms.

    ``{"tiny-gpt2": dir (GPT-2, byte-level BPE), "tiny-llama": dir (Llama, Unigram)}``.
    """
    return build_tiny_models(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture()
def tiny_config(tiny_models: dict[str, Path]) -> dict:
    """A 2-policy run config dict on the tiny models and the zoo task (a few steps)."""
    return {
        "policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                     {"name": "b", "model": str(tiny_models["tiny-llama"])}],
        "task": {"preset": "zoo", "test_size": 40},
        "grpo": {"num_generations": 4, "max_completion_length": 6},
        "steps": 3, "prompts_per_step": 4, "eval_every": 2, "eval_size": 40, "checkpoint_every": 2,
    }


@pytest.fixture(scope="session")
def trained_zoo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run of two shipped zoo policies that share (``imitate``): ``g`` (zoo:gpt2-add,
    every weight trained) and ``l`` (zoo:llama-sub, a LoRA adapter), checkpoints after steps 1 and 2,
    held-out evaluations at steps 0, 1 and 2, the final models under ``final/`` (``save_final_model``).
    A dense reward (shorter is better) with dynamic sampling off makes every step move the weights.
    Read-only for its users (tests/test_export.py, tests/test_eval_model.py)."""
    from mutualrl.run.trainer import MutualTrainer

    cfg = {"policies": [{"name": "g", "model": "zoo:gpt2-add"},
                        {"name": "l", "model": "zoo:llama-sub", "grpo": {"learning_rate": 3e-2},
                         "peft": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}],
           "task": {"preset": "zoo", "test_size": 20, "train_size": 200,
                    "reward_functions": ["test_trainer:reward_brevity"]},
           "grpo": {"num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-3,
                    "dynamic_sampling": "off"},
           "sharing": {"strategy": "imitate"},
           "steps": 2, "prompts_per_step": 4, "eval_every": 1, "eval_size": 20, "checkpoint_every": 1,
           "threads": 1, "save_final_model": True}
    run_dir = tmp_path_factory.mktemp("zoo_run") / "run"
    MutualTrainer(cfg, run_dir, progress=False).train()
    return run_dir
