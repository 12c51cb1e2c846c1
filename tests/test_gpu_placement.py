"""GPU placement without a GPU: which GPU ``cuda`` and ``cuda:N`` mean, the ``CUDA_VISIBLE_DEVICES``
a worker process is given under a parent's own list."""

from __future__ import annotations

import os
import subprocess
from typing import ClassVar

import pytest

from mutualrl.allocation import local
from mutualrl.allocation.local import LocalScheduler, child_visible_devices
from mutualrl.allocation.placement import physical_gpu, place
from mutualrl.allocation.planner import Allocation, Placement, Resources
from mutualrl.resolve import resolve


# ----------------------------------------------------------------------------- cuda / cuda:N
@pytest.mark.parametrize(("policy", "run", "planned", "want"), [
    ("cuda", "auto", 1, 1),      # plain cuda: a GPU, the plan's
    ("auto", "cuda", 1, 1),      # ... also from the run level
    ("cuda", "auto", None, 0),   # ... GPU 0 where the plan has none
    ("cuda:1", "auto", 0, 1),    # cuda:N pins
    ("auto", "cuda:1", 0, 1),
    ("cuda:0", "cuda:1", 1, 0),  # the policy's first
    ("cpu", "cuda", 1, None),
    ("auto", "cpu", 1, None),
    ("auto", "auto", 1, 1),
    ("auto", "auto", None, None),
])
def test_plain_cuda_lets_the_plan_decide_and_cuda_n_pins(policy, run, planned, want):
    assert physical_gpu(policy, run, planned) == want


def test_two_policies_on_plain_cuda_get_the_gpus_the_plan_gives_them(tiny_config, monkeypatch):
    """Before, ``device: cuda`` put every policy on GPU 0 whatever the plan said."""
    from mutualrl import devices

    monkeypatch.setattr(devices, "cuda_count", lambda: 2)  # a config may name cuda: as if two GPUs were here
    cfg = {**tiny_config, "policies": [{**p, "device": "cuda"} for p in tiny_config["policies"]]}
    plan = resolve(cfg, check_paths=False)
    alloc = Allocation([Placement(i, p.name, 0, 1.0, 1, gpu=i, gpu_fraction=1.0)
                        for i, p in enumerate(plan.config.policies)], Resources(cpus=2), "gpu")
    placed = place(plan, alloc, "local", "memory://x")
    assert [(w.device, w.visible_gpu) for w in placed.workers] == [("cuda:0", 0), ("cuda:0", 1)]
    seq = place(plan, alloc, "sequential", "memory://x")
    assert [w.device for w in seq.workers] == ["cuda:0", "cuda:1"]
    pinned = resolve({**cfg, "policies": [{**p, "device": "cuda:1"} for p in tiny_config["policies"]]},
                     check_paths=False)
    assert [w.device for w in place(pinned, alloc, "sequential", "memory://x").workers] == ["cuda:1", "cuda:1"]


# ----------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES
@pytest.mark.parametrize(("gpu", "parent", "want"), [
    (0, None, "0"),
    (3, None, "3"),
    (0, "2,3", "2"),
    (1, "2,3", "3"),
    (1, " 2, 3 ", "3"),
    (1, "GPU-8a1b2c3d-0000-1111-2222-333344445555,GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff",
     "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"),
    (0, "MIG-5c1f7e2a-1234-5678-9abc-def012345678,MIG-GPU-8a1b2c3d/1/0",
     "MIG-5c1f7e2a-1234-5678-9abc-def012345678"),
    (1, "MIG-5c1f7e2a-1234-5678-9abc-def012345678,MIG-GPU-8a1b2c3d/1/0", "MIG-GPU-8a1b2c3d/1/0"),
])
def test_a_worker_gets_the_parents_entry_of_its_gpu(gpu, parent, want):
    assert child_visible_devices(gpu, parent) == want


@pytest.mark.parametrize(("gpu", "parent"), [(2, "2,3"), (0, ""), (1, "GPU-abc"), (-1, None)])
def test_a_gpu_the_parent_does_not_see_is_a_clear_error(gpu, parent):
    with pytest.raises(ValueError, match="GPU"):
        child_visible_devices(gpu, parent)


class _FakePopen:
    """Records the environment a worker process would be started with."""

    envs: ClassVar[list[dict[str, str]]] = []

    def __init__(self, args, *, env, **kw):
        _FakePopen.envs.append(env)
        r, w = os.pipe()
        os.close(w)
        self.stdout = os.fdopen(r, "rb")
        self.stdin = None

    def poll(self):
        return 0


@pytest.mark.parametrize(("parent", "want_visible"), [(None, "1"), ("4,6", "6"), ("GPU-aaaa,GPU-bbbb", "GPU-bbbb")])
def test_a_local_worker_on_a_gpu_gets_the_parents_entry(tmp_path, monkeypatch, parent, want_visible):
    monkeypatch.setattr(local.subprocess, "Popen", _FakePopen)
    if parent is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    _FakePopen.envs = []
    sched = LocalScheduler(verbose=False)
    on_gpu = sched._spawn(0, "a", 1, tmp_path / "a.log", gpu=1)
    on_cpu = sched._spawn(1, "b", 1, tmp_path / "b.log", gpu=None)
    for p in (on_gpu, on_cpu):
        p.log.close()
        p.popen.stdout.close()
    gpu_env, cpu_env = _FakePopen.envs
    assert gpu_env["CUDA_VISIBLE_DEVICES"] == want_visible
    assert cpu_env.get("CUDA_VISIBLE_DEVICES") == parent  # a CPU worker's environment is the parent's


def test_the_fake_popen_is_not_left_behind():
    assert local.subprocess.Popen is subprocess.Popen
