"""A study running several runs at once gives way to memory instead of losing a run to the OOM killer
(:meth:`mutualrl.study.Study.run`): the machine's processes are faked, the decisions are real."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from mutualrl.study import Arm, Study, harness


class FakeRun:
    """A run process that finishes after ``polls`` polls with ``code`` (or is terminated first)."""

    def __init__(self, cmd: list[str], state: dict) -> None:
        self.dir = Path(cmd[3])
        self.name = self.dir.name
        self.polls, self.code = state["plan"][self.name].pop(0)
        self.returncode: int | None = None
        # its memory price (bytes, of a machine of 100) lands after ``priced_after`` polls
        self.price, self.priced_after = state["price"].get(self.name, (1, 0))
        self.polled = 0
        self.pid = len(state["launched"]) + 1_000_000  # what the fake process table knows it by
        state["pids"][self.pid] = self.name
        self._price()
        self.live = state["live"]
        self.live.add(self.name)
        state["most_live"] = max(state["most_live"], len(self.live))
        state["launched"].append((self.name, "--resume" in cmd))
        state["beside"].append(sorted(self.live - {self.name}))  # the runs going as it started

    def _end(self, code: int) -> None:
        self.returncode = code
        self.live.discard(self.name)

    def _price(self) -> None:
        if self.polled == self.priced_after:
            with (self.dir / "metrics.jsonl").open("a") as f:
                f.write('{"event": "eval", "policy": "p", "step": 0, "val_acc": 0.1}\n')
                f.write(json.dumps({"policy": "p", "step": 0, "rss_peak_mb": self.price / 2**20 / 2,
                                    "mem_predicted_peak_mb": self.price / 2**20}) + "\n")

    def poll(self) -> int | None:
        if self.returncode is None:
            self.polled += 1
            self._price()
            self.polls -= 1
            if self.polls <= 0:
                self._end(self.code)
        return self.returncode

    def terminate(self) -> None:
        if self.returncode is None:
            self._end(-signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@pytest.fixture
def fake_study(monkeypatch, tmp_path):
    """A two-job study whose runs are :class:`FakeRun` processes, its state and a maker of another:
    ``state['available']`` is the memory available (of 100; or a function), ``state['plan']`` each
    run's launches (polls, exit code), ``state['price']`` a run's memory price (of 100) and the polls
    before it lands (default 1, at once), ``state['launched']`` what started, ``state['beside']`` what
    ran as each started, ``state['most_live']`` the most at once, ``state['live']`` what runs now,
    ``state['checkpoint']`` the runs that have one, ``state['holds']`` what a run's processes hold
    now (unknown: nothing)."""
    from mutualrl.run import checkpoint

    states: list[dict] = []
    def available() -> int:
        have = states[-1]["available"]
        return have() if callable(have) else have

    monkeypatch.setattr(harness, "available_bytes", available)
    monkeypatch.setattr(harness, "machine_bytes", lambda: 100)
    monkeypatch.setattr(harness, "process_tree_rss",
                        lambda pid: states[-1]["holds"].get(states[-1]["pids"].get(pid)))
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)
    monkeypatch.setattr(harness.subprocess, "Popen",
                        lambda cmd, **kw: FakeRun(cmd, states[-1]))
    monkeypatch.setattr(checkpoint, "latest_checkpoint",
                        lambda d: Path(d) / "checkpoints" / "step_20" if Path(d).name in states[-1]["checkpoint"] else None)

    def fresh() -> tuple[Study, dict]:
        state: dict = {"available": 100, "plan": {}, "launched": [], "recorded": [], "checkpoint": set(),
                       "live": set(), "price": {}, "most_live": 0, "beside": [],
                       "pids": {}, "holds": {}}
        states.append(state)
        study = Study("t", lambda seed: {"seed": seed}, tmp_path / f"runs{len(states)}", results=tmp_path, jobs=2)

        def prepare(arm: Arm, seed: int) -> tuple[Path, bool]:
            d = study.out / f"{arm.name}-seed{seed}"
            d.mkdir(parents=True, exist_ok=True)
            return d, False

        monkeypatch.setattr(study, "_prepare", prepare)
        monkeypatch.setattr(study, "_record", lambda d: state["recorded"].append(d.name))
        return study, state

    return (*fresh(), fresh)


def test_low_memory_stops_the_youngest_run_which_resumes_later_one_at_a_time(fake_study):
    study, state, _ = fake_study
    arms = [Arm(n, "f", "baseline") for n in ("a", "b", "c")]
    state["plan"] = {"a-seed0": [(5, 0)], "b-seed0": [(50, 0), (3, 0)], "c-seed0": [(3, 0)]}
    state["checkpoint"] = {"b-seed0"}
    state["available"] = lambda: 5 if {"a-seed0", "b-seed0"} <= state["live"] else 100  # short while both run
    study.run((arm, 0) for arm in arms)
    # b, the younger of the two, is stopped and resumed from its checkpoint before c starts; after
    # the stop one run goes at a time (b again only once a has finished, c once b has)
    assert state["launched"] == [("a-seed0", False), ("b-seed0", False), ("b-seed0", True), ("c-seed0", False)]
    assert sorted(state["recorded"]) == ["a-seed0", "b-seed0", "c-seed0"]
    assert study._at_once() == 1


def test_a_run_that_ends_as_memory_runs_short_is_recorded_not_stopped(fake_study):
    study, state, _ = fake_study
    state["plan"] = {"a-seed0": [(9, 0)], "b-seed0": [(2, 0)]}  # b ends on the guard's own poll
    state["available"] = 5
    study.run((Arm(n, "f", "baseline"), 0) for n in ("a", "b"))
    assert state["launched"] == [("a-seed0", False), ("b-seed0", False)]
    assert sorted(state["recorded"]) == ["a-seed0", "b-seed0"] and study._memory_cap is None


def test_a_single_run_is_never_stopped_for_memory(fake_study):
    study, state, _ = fake_study
    state["available"] = 1
    state["plan"] = {"a-seed0": [(4, 0)]}
    study.run([(Arm("a", "f", "baseline"), 0)])  # two jobs, one run
    assert state["launched"] == [("a-seed0", False)] and state["recorded"] == ["a-seed0"]


def test_a_run_the_oom_killer_took_beside_another_runs_again_once(fake_study):
    study, state, fresh = fake_study
    arms = [Arm(n, "f", "baseline") for n in ("a", "b")]
    # b is SIGKILLed beside a: it runs again afresh (no checkpoint yet), alone, and finishes
    state["plan"] = {"a-seed0": [(6, 0)], "b-seed0": [(2, -signal.SIGKILL), (2, 0)]}
    study.run((arm, 0) for arm in arms)
    assert state["launched"] == [("a-seed0", False), ("b-seed0", False), ("b-seed0", False)]
    assert sorted(state["recorded"]) == ["a-seed0", "b-seed0"]
    # three at once: d is killed beside c and e, resumes from its checkpoint beside c once e has ended
    # (two at once now), and is killed there again: no third try, though another run ran beside it
    study2, state2 = fresh()
    study2.jobs = 3
    state2["plan"] = {"c-seed0": [(40, 0)], "d-seed0": [(2, -signal.SIGKILL), (2, -signal.SIGKILL)],
                      "e-seed0": [(5, 0)]}
    state2["checkpoint"] = {"d-seed0"}
    with pytest.raises(harness.RunFailed, match=r"d seed 0 failed \(exit -9\)"):
        study2.run((Arm(n, "f", "baseline"), 0) for n in ("c", "d", "e"))
    assert state2["launched"] == [("c-seed0", False), ("d-seed0", False), ("e-seed0", False), ("d-seed0", True)]
    assert state2["recorded"] == ["e-seed0"] and study2._at_once() == 2


def test_a_run_that_fails_alone_stops_the_study(fake_study):
    study, state, _ = fake_study
    state["plan"] = {"a-seed0": [(2, -signal.SIGKILL)]}
    with pytest.raises(harness.RunFailed, match="exit -9"):
        study.run([(Arm("a", "f", "baseline"), 0)])


def test_another_run_starts_only_where_its_price_fits_beside_those_going(fake_study):
    study, state, fresh = fake_study
    # priced at 60 of 100 each: two would need 120; b waits for a to end, c for b, whatever jobs says
    state["plan"] = {n: [(4, 0)] for n in ("a-seed0", "b-seed0", "c-seed0")}
    state["price"] = {n: (60, 0) for n in state["plan"]}
    messages: list[str] = []
    study.say = messages.append
    study.run((Arm(n, "f", "baseline"), 0) for n in ("a", "b", "c"))
    assert state["most_live"] == 1 and state["beside"] == [[], [], []]
    assert sorted(state["recorded"]) == ["a-seed0", "b-seed0", "c-seed0"]
    held = [m for m in messages if m.startswith("memory: ")]
    assert len(held) == 2 and "b waits for one of the 1 run(s) going to end" in held[0]  # once a wait
    assert "2 runs at once would need" in held[0] and held[1].startswith("memory: c waits")
    assert study._memory_cap is None  # held back, never stopped: later, smaller runs may go together
    # priced at 30 each: 60 with the next, under 92: two at once
    study2, state2 = fresh()
    state2["plan"] = {n: [(6, 0)] for n in ("a-seed0", "b-seed0")}
    state2["price"] = {n: (30, 0) for n in state2["plan"]}
    study2.run((Arm(n, "f", "baseline"), 0) for n in ("a", "b"))
    assert state2["most_live"] == 2 and state2["beside"] == [[], ["a-seed0"]]
    # 47 + 47 = 94: over the 92 % the floor leaves
    study3, state3 = fresh()
    state3["plan"] = {n: [(6, 0)] for n in ("a-seed0", "b-seed0")}
    state3["price"] = {n: (47, 0) for n in state3["plan"]}
    study3.run((Arm(n, "f", "baseline"), 0) for n in ("a", "b"))
    assert state3["most_live"] == 1
    # 30 + 30 fits the machine, but other processes leave only 35 available: 35 - 30 is under the floor
    study4, state4 = fresh()
    state4["plan"] = {n: [(6, 0)] for n in ("a-seed0", "b-seed0")}
    state4["price"] = {n: (30, 0) for n in state4["plan"]}
    state4["available"] = 35
    study4.run((Arm(n, "f", "baseline"), 0) for n in ("a", "b"))
    assert state4["most_live"] == 1
    # 60 available: enough for b only once a holds its whole price already (60 - 0 - 30), not while a
    # holds nothing yet and will take 30 more (60 - 30 - 30)
    for holds, together in (({}, False), ({"a-seed0": 30}, True)):
        study5, state5 = fresh()
        state5["plan"] = {n: [(6, 0)] for n in ("a-seed0", "b-seed0")}
        state5["price"] = {n: (30, 0) for n in state5["plan"]}
        state5["available"], state5["holds"] = 60, holds
        study5.run((Arm(n, "f", "baseline"), 0) for n in ("a", "b"))
        assert (state5["most_live"] == 2) is together


def test_the_next_run_is_priced_at_what_its_arm_reached_before(fake_study):
    study, state, fresh = fake_study
    # a later seed of a big arm (60) waits beside a run of 40: priced at what its arm reached, not at
    # the price of the run going (40 + 40 would have let it start)
    state["plan"] = {"big-seed0": [(3, 0)], "mid-seed0": [(8, 0)], "big-seed1": [(3, 0)]}
    state["price"] = {"big-seed0": (60, 0), "mid-seed0": (40, 0), "big-seed1": (60, 0)}
    big, mid = Arm("big", "f", "sharing"), Arm("mid", "f", "baseline")
    study.run([(big, 0), (mid, 0), (big, 1)])  # mid, unknown, is priced at the largest seen: it waits too
    assert state["most_live"] == 1 and state["beside"] == [[], [], []]
    # a small arm's later seed (10) joins a big run (60): 70 fits; the largest price seen would not
    study2, state2 = fresh()
    state2["plan"] = {"small-seed0": [(2, 0)], "big-seed0": [(12, 0)], "small-seed1": [(3, 0)]}
    state2["price"] = {"small-seed0": (10, 0), "big-seed0": (60, 0), "small-seed1": (10, 0)}
    small = Arm("small", "f", "baseline")
    study2.run([(small, 0), (big, 0), (small, 1)])
    # (big seed 0 itself, of an arm not yet priced, started beside small seed 0 at small's price:
    # the reactive guard is what covers a first run of a larger arm)
    assert state2["beside"] == [[], ["small-seed0"], ["big-seed0"]]


def test_another_run_waits_until_the_runs_going_have_priced_their_memory(fake_study):
    study, state, _ = fake_study
    # a prices itself only after 3 polls (its step 0): b starts beside it, but only once a has a price
    state["plan"] = {"a-seed0": [(8, 0)], "b-seed0": [(3, 0)]}
    state["price"] = {"a-seed0": (10, 3), "b-seed0": (10, 0)}
    polls_before_b: list[int] = []
    real_launch = study._launch

    def launch(arm, seed, d, resume, threads):
        if arm.name == "b":
            polls_before_b.append(state["procs"][0].polled)
        run = real_launch(arm, seed, d, resume, threads)
        state["procs"].append(run.proc)
        return run

    state["procs"] = []
    study._launch = launch
    study.run((Arm(n, "f", "baseline"), 0) for n in ("a", "b"))
    assert state["beside"] == [[], ["a-seed0"]] and polls_before_b == [3]


def test_a_run_price_reads_whole_lines_and_takes_the_larger_figure(tmp_path):
    from mutualrl.study.run_price import RunPrice

    metrics = tmp_path / "metrics.jsonl"
    price, apart = RunPrice(tmp_path), RunPrice(tmp_path, one_process=False)
    assert price.bytes() is None  # no metrics yet
    metrics.write_text('{"event": "eval", "policy": "a", "step": 0}\n{"policy": "a", "step": 0, "rss_')
    assert price.bytes() is None  # an evaluation and half a step: not priced yet
    with metrics.open("a") as f:
        f.write('peak_mb": 100, "mem_predicted_peak_mb": 300}\n'
                '{"policy": "b", "step": 0, "rss_peak_mb": 200, "mem_predicted_peak_mb": NaN}\n'
                '{"policy": "a", "step": 1, "rss_peak_mb": 400, "mem_predicted_peak_mb": 300}\n')
    # a: the larger of predicted and measured over its steps (400); b: its measured 200 (NaN ignored)
    assert price.bytes() == 400 * 2**20  # one process: the largest policy's
    assert apart.bytes() == 600 * 2**20  # a process each: their sum


def test_one_process_is_priced_at_its_residents_and_one_transient(tmp_path):
    from mutualrl.allocation.memory import PROCESS_BYTES
    from mutualrl.study.run_price import RunPrice

    mib = 2**20
    step = '{{"policy": "{}", "step": 0, "rss_peak_mb": {}, "mem_predicted_peak_mb": {}{}}}\n'
    (tmp_path / "metrics.jsonl").write_text(
        step.format("s", 100, 9000, ', "mem_predicted_resident_mb": 3000, "worker_processes": 1')
        + step.format("g", 100, 12000, ', "mem_predicted_resident_mb": 5500, "worker_processes": 1'))
    # both residents in the one process (its overhead once) and the larger transient (6500)
    assert RunPrice(tmp_path).bytes() == (3000 + 5500 + 6500) * mib - PROCESS_BYTES
    # their workers apart (2 ranks for g): each worker its whole peak
    (tmp_path / "metrics.jsonl").write_text(
        step.format("s", 100, 9000, "") + step.format("g", 100, 12000, ', "worker_processes": 2'))
    assert RunPrice(tmp_path, one_process=False).bytes() == (9000 + 2 * 12000) * mib
    # no resident figure (an older run): every whole peak, the overhead once
    assert RunPrice(tmp_path).bytes() == (9000 + 12000) * mib - PROCESS_BYTES


def test_a_run_price_reads_a_rewritten_metrics_file_from_its_start(tmp_path):
    from mutualrl.study.run_price import RunPrice

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f'{{"policy": "a", "step": {i}, "rss_peak_mb": 10}}\n' for i in range(20)))
    price = RunPrice(tmp_path)
    assert price.bytes() == 10 * 2**20
    fresh = tmp_path / "metrics.new"  # a resume rewrites it shorter, as a new file
    fresh.write_text('{"policy": "a", "step": 0, "rss_peak_mb": 10}\n')
    fresh.replace(metrics)
    with metrics.open("a") as f:
        f.write('{"policy": "a", "step": 1, "rss_peak_mb": 50}\n')
    assert price.bytes() == 50 * 2**20


def test_a_process_trees_resident_bytes_count_its_children():
    import subprocess
    import sys

    from mutualrl.allocation.memory import process_tree_rss

    alone = process_tree_rss(os.getpid())
    assert alone is not None and alone > 10 * 2**20
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 * 2**20); time.sleep(30)"])
    try:
        for _ in range(100):  # until the child has its 200 MiB
            with_child = process_tree_rss(os.getpid())
            if with_child - process_tree_rss(child.pid) >= 0 and process_tree_rss(child.pid) > 200 * 2**20:
                break
            time.sleep(0.05)
        assert process_tree_rss(child.pid) > 200 * 2**20
        assert process_tree_rss(os.getpid()) > alone + 190 * 2**20
    finally:
        child.kill()
        child.wait()
    assert process_tree_rss(child.pid) is None  # gone


def test_a_policy_the_plan_could_not_price_is_left_to_its_measurement(tmp_path):
    from mutualrl.study.run_price import RunPrice

    mib = 2**20
    (tmp_path / "metrics.jsonl").write_text(
        '{"policy": "s", "step": 0, "rss_peak_mb": 100, "mem_predicted_peak_mb": 9000, '
        '"mem_predicted_resident_mb": 3000}\n{"policy": "x", "step": 0, "rss_peak_mb": 100}\n')
    assert RunPrice(tmp_path).bytes() == 9000 * mib  # s's prediction whole: x adds no overhead to take off
    (tmp_path / "metrics.jsonl").write_text('{"policy": "x", "step": 0, "rss_peak_mb": 100}\n')
    assert RunPrice(tmp_path).bytes() == 100 * mib  # nothing predicted: the measurement alone


def test_available_memory_counts_a_cgroups_limit_below_the_machines(tmp_path):
    from mutualrl.allocation.memory import available_bytes, machine_bytes, physical_bytes

    mib = 2**20
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {physical_bytes() // 1024} kB\nMemAvailable: {8 * 1024 * 1024} kB\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{1024 * mib}\n")
    (v2 / "memory.current").write_text(f"{800 * mib}\n")
    (v2 / "memory.stat").write_text(f"anon {600 * mib}\ninactive_file {100 * mib}\n")
    # the container's limit (1 GiB) less what it uses (800 MiB) plus its reclaimable cache (100 MiB)
    assert available_bytes(meminfo, v2) == 324 * mib and machine_bytes(v2) == 1024 * mib
    (v2 / "memory.max").write_text("max\n")  # no limit: the machine's MemAvailable
    assert available_bytes(meminfo, v2) == 8 * 2**30 and machine_bytes(v2) == physical_bytes()
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2048 * mib}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{1000 * mib}\n")
    (v1 / "memory" / "memory.stat").write_text(f"total_inactive_file {24 * mib}\n")
    assert available_bytes(meminfo, v1) == 1072 * mib and machine_bytes(v1) == 2048 * mib
