"""A zoo builder in its own process stops when the ``zoo build`` that started it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from mutualrl.zoo.specs import ZOO


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive (a zombie waiting to be reaped by whoever adopted it counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_builder_whose_parent_was_killed_stops(tmp_path):
    """The parent (a Python process standing in for ``zoo build``) starts a real build and is killed with
    SIGKILL, which it cannot handle: the builder notices it was orphaned and exits, with nothing
    renamed into the target."""
    spec = json.dumps(ZOO["gpt2-add"].to_dict())
    target = tmp_path / "gpt2-add"
    child = [sys.executable, "-m", "mutualrl.zoo.child", "--spec", spec, "--seed", "0",
             "--target", str(target), "--quiet"]
    script = ('import subprocess, sys, os\n'
              f'p = subprocess.Popen({child!r} + ["--parent", str(os.getpid())])\n'
              'print(p.pid, flush=True)\n'
              'p.wait()\n')
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    builder = int(parent.stdout.readline())
    time.sleep(0.5)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60  # the builder is the killed parent's child, not ours: poll it by pid
    while _running(builder):
        if time.monotonic() > deadline:
            os.kill(builder, signal.SIGKILL)
            raise AssertionError("the orphaned builder was still running 60 s after its parent was killed")
        time.sleep(0.2)
    assert not target.exists()


def test_a_policy_worker_whose_controller_was_killed_stops(tmp_path):
    """The local scheduler's worker (``mutualrl.allocation.worker_main``) has the same watch: its
    controller (a Python process standing in for a run) is killed with SIGKILL while the worker's stdin
    stays open (this test holds the other end), so the worker never reads an end of input, as in the
    middle of a long call: it notices it was orphaned and exits."""
    r, w = os.pipe()
    worker_cmd = [sys.executable, "-m", "mutualrl.allocation.worker_main"]
    script = ('import subprocess, sys, os\n'
              f'p = subprocess.Popen({worker_cmd!r} + ["--parent", str(os.getpid())], stdin={r})\n'
              'print(p.pid, flush=True)\n'
              'p.wait()\n')
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, pass_fds=(r,))
    os.close(r)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.5)
        assert _running(worker)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while _running(worker):
            if time.monotonic() > deadline:
                os.kill(worker, signal.SIGKILL)
                raise AssertionError("the orphaned worker was still running 30 s after its controller was killed")
            time.sleep(0.2)
    finally:
        os.close(w)
