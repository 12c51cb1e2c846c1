"""GPU placement without a GPU: which GPU ``cuda`` and ``cuda:N`` mean, the ``CUDA_VISIBLE_DEVICES``
a worker process is given under a parent's own list, the memory shares of the processes on one
GPU, and the caching allocator's setting in a worker's environment (local processes, Ray actors)."""

from __future__ import annotations

import os
import subprocess
from typing import ClassVar

import pytest

from mutualrl.allocation import local
from mutualrl.allocation.gpu_memory import (
    ALLOC_CONF,
    EXPANDABLE,
    GPU_MEMORY_HEADROOM,
    allocator_env,
    memory_shares,
)
from mutualrl.allocation.local import LocalScheduler, child_visible_devices
from mutualrl.allocation.placement import physical_gpu, place
from mutualrl.allocation.planner import Allocation, Placement, Resources
from mutualrl.config import GRPOOptions
from mutualrl.config.resolve import WorkerSpec, resolve


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
    from mutualrl.run import devices

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
    pinned_devices = [w.device for w in place(pinned, alloc, "sequential", "memory://x").workers]
    assert pinned_devices == ["cuda:1", "cuda:1"]


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


@pytest.mark.parametrize(("parent", "user_conf", "want_visible", "want_conf"), [
    (None, None, "1", EXPANDABLE),
    ("4,6", None, "6", EXPANDABLE),
    ("GPU-aaaa,GPU-bbbb", "max_split_size_mb:128", "GPU-bbbb", "max_split_size_mb:128"),
])
def test_a_local_worker_on_a_gpu_gets_the_mapped_gpu_and_expandable_segments(
        tmp_path, monkeypatch, parent, user_conf, want_visible, want_conf):
    monkeypatch.setattr(local.subprocess, "Popen", _FakePopen)
    for key, value in (("CUDA_VISIBLE_DEVICES", parent), (ALLOC_CONF, user_conf)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    _FakePopen.envs = []
    sched = LocalScheduler(verbose=False)
    on_gpu = sched._spawn(0, "a", 1, tmp_path / "a.log", gpu=1)
    on_cpu = sched._spawn(1, "b", 1, tmp_path / "b.log", gpu=None)
    for p in (on_gpu, on_cpu):
        p.log.close()
        p.popen.stdout.close()
    gpu_env, cpu_env = _FakePopen.envs
    assert gpu_env["CUDA_VISIBLE_DEVICES"] == want_visible and gpu_env[ALLOC_CONF] == want_conf
    assert cpu_env.get("CUDA_VISIBLE_DEVICES") == parent  # a CPU worker's environment is the parent's
    assert cpu_env.get(ALLOC_CONF) == user_conf


def test_a_ray_actor_on_a_gpu_gets_expandable_segments_unless_the_user_set_the_allocator():
    from mutualrl.allocation.ray_scheduler import actor_env

    gpu = WorkerSpec(index=0, name="a", options=GRPOOptions(), device="cuda:0")
    cpu = WorkerSpec(index=1, name="b", options=GRPOOptions(), device="cpu")
    assert actor_env(gpu, {}) == {ALLOC_CONF: EXPANDABLE}
    assert actor_env(cpu, {}) == {}
    assert actor_env(gpu, {}, engine="vllm") == {}  # vLLM's sleep-mode pool refuses expandable segments
    assert actor_env(gpu, {ALLOC_CONF: "backend:cudaMallocAsync"}) == {}
    assert actor_env(gpu, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
    assert actor_env(gpu, {}, job_env={ALLOC_CONF: "max_split_size_mb:64"}) == {}


def test_allocator_env_keeps_what_the_user_set():
    assert allocator_env({}) == {ALLOC_CONF: EXPANDABLE}
    assert allocator_env({ALLOC_CONF: "x"}) == {}


# ----------------------------------------------------------------------------- memory shares
def test_the_shares_on_one_gpu_sum_to_at_most_the_headroom():
    got = memory_shares([((None, 0), 0.7), ((None, 0), 0.3), ((None, 1), 0.5), ((None, 1), 0.3), (None, None),
                         ((None, 2), None), (("node-b", 0), 1.0)])
    assert got[0] == pytest.approx(0.63) and got[1] == pytest.approx(0.27)
    assert got[2:4] == [0.5, 0.3]  # already within the headroom: left alone
    assert got[4:6] == [None, None]
    assert got[6] == pytest.approx(GPU_MEMORY_HEADROOM)  # one process, a share of 1: still leaves headroom
    assert sum(got[:2]) <= GPU_MEMORY_HEADROOM + 1e-9
    with pytest.raises(ValueError, match="share"):
        memory_shares([((None, 0), 1.5)])


def test_placed_workers_sharing_a_gpu_leave_headroom(tiny_config):
    plan = resolve({**tiny_config, "device": "auto"}, check_paths=False)
    gpu = [Placement(i, p.name, 0, 1.0, 1, gpu=0, gpu_fraction=f) for i, (p, f) in
           enumerate(zip(plan.config.policies, (0.7, 0.3), strict=True))]
    alloc = Allocation(gpu, Resources(cpus=2), "gpu")
    for backend in ("local", "ray"):
        placed = place(plan, alloc, backend, "memory://x")
        shares = [w.gpu_fraction for w in placed.workers]
        assert shares == [pytest.approx(0.63), pytest.approx(0.27)], backend
        assert sum(shares) <= GPU_MEMORY_HEADROOM + 1e-9
    assert [w.gpu_fraction for w in place(plan, alloc, "sequential", "memory://x").workers] == [None, None]


def test_the_fake_popen_is_not_left_behind():
    assert local.subprocess.Popen is subprocess.Popen
