"""Reliability benchmark: exact resume, kill -9 crash trials, a hostile peer, bad input, full disk.

    python benchmarks/faults.py            # full run (writes benchmarks/results/faults.json)
    python benchmarks/faults.py --quick    # fewer kills, bad input checked in-process

Everything runs on two tiny, untrained, heterogeneous policies (GPT-2 + byte BPE, Llama +
Unigram) built locally, so the figures are about the machinery, not about learning:

1. **Resume**: an uninterrupted reference run (in this process) against a run that is killed and
   resumed many times (separate ``python -m mutualrl.cli train`` processes); the max abs diff of
   every numeric metric (timings excluded) between the two ``metrics.jsonl``.
2. **Kill trials**: each kill is either ``MUTUALRL_FAULT_POINT=<point>:<n>`` (the process
   SIGKILLs itself inside rollout, exchange publish, update, checkpoint write or commit) or a
   ``kill -9`` from outside at a random moment after training started. After every kill every
   checkpoint on disk must load; at the end the exchange must hold every acknowledged record
   (``MUTUALRL_ACK_LOG``) exactly once and the same records as the reference run.
3. **Hostile peer**: >= 1,000 hostile rows through ``publish_json`` (counted by reason), the
   stored ones checked against the learner's trust filter and SGT re-verification, and a training
   run with the hostile rows in its exchange compared with a clean run.
4. **Bad input**: >= 15 bad CLI/config cases; each must exit 2 with one message and leave the
   directory byte-for-byte unchanged.
5. **Full disk / locked exchange**: a run directory on a tiny tmpfs (root) or an injected ENOSPC,
   and an exchange held locked by another connection.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from _hostile import hostile_rows

from mutualrl.run.tracking import is_measurement

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REWARD_MODULE = '''
"""Dense test reward (share of digits in the completion): gives the untrained policies gradients."""


def digits(prompts, completions, **columns):
    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]
'''


def load_reward_module(path: Path) -> None:
    """Import the written reward module by its path as ``faults_reward``, so that the runs in this
    process resolve ``faults_reward:digits`` (the runs in subprocesses find it on their PYTHONPATH)."""
    spec = importlib.util.spec_from_file_location("faults_reward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["faults_reward"] = module
    spec.loader.exec_module(module)


# ----------------------------------------------------------------------------- setup
def run_config(models: dict[str, Path], steps: int, **extra: Any) -> dict[str, Any]:
    """A 2-policy run on the tiny models with a dense extra reward (module ``faults_reward``)."""
    cfg = {
        "policies": [{"name": "a", "model": str(models["tiny-gpt2"])},
                     {"name": "b", "model": str(models["tiny-llama"])}],
        "task": {"preset": "zoo", "test_size": 24, "reward_functions": ["faults_reward:digits"]},
        "grpo": {"num_generations": 4, "max_completion_length": 6, "learning_rate": 3e-3},
        "sharing": {"strategy": "xgrpo+sgt"},
        "steps": steps, "prompts_per_step": 4, "eval_every": 4, "eval_size": 24, "eval_batch_size": 24,
        "checkpoint_every": 2, "threads": 1,
    }
    cfg.update(extra)
    return cfg


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def subprocess_env(work: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTUALRL_FAULT")}
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(ROOT), env.get("PYTHONPATH", "")])
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def train_in_process(cfg: dict[str, Any], run_dir: Path | None) -> list[dict[str, Any]]:
    """Run a config with MutualTrainer here; return its metric rows."""
    from mutualrl.run.trainer import MutualTrainer

    tr = MutualTrainer(cfg, run_dir, progress=False)
    tr.train()
    return list(tr.history)


# ----------------------------------------------------------------------------- comparisons
def read_metrics(path: Path) -> dict[tuple, dict[str, Any]]:
    """metrics.jsonl keyed by (step, policy, event)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        out[(r["step"], r["policy"], r.get("event", "train"))] = r
    return out


def metric_max_diff(a: dict[tuple, dict], b: dict[tuple, dict]) -> tuple[float, str]:
    """Max abs diff over every numeric metric except measurements of the machine (time, memory) and a note.

    A row or a metric present on one side only counts as an infinite difference.
    """
    worst, where = 0.0, "identical"
    for key in set(a) | set(b):
        if key not in a or key not in b:
            return float("inf"), f"row {key} only on one side"
        ra, rb = a[key], b[key]
        for f in set(ra) | set(rb):
            if is_measurement(f) or f in ("step", "policy", "event"):
                continue
            va, vb = ra.get(f), rb.get(f)
            if not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
                if va != vb:
                    return float("inf"), f"{key} {f}: {va!r} vs {vb!r}"
                continue
            d = abs(float(va) - float(vb))
            if d > worst:
                worst, where = d, f"{key} {f}"
    return worst, where


def exchange_records(db: Path) -> list[Any]:
    """Every record stored in a sqlite exchange file (read-only)."""
    from mutualrl.experience import RECORD_TYPES, from_row

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(experience)")]
        vcols = [c for c in cols if c.startswith("v") and c[1:].isdigit()]
        rows = conn.execute(f"SELECT kind, record_id, arrays, {', '.join(vcols)} FROM experience ORDER BY seq")
        out = []
        for kind, rid, arrays, *vals in rows:
            n = len(RECORD_TYPES[kind].SCALAR_FIELDS)
            out.append(from_row(kind, rid, tuple(vals[:n]), arrays))
        return out
    finally:
        conn.close()


def semantic_key(r: Any) -> tuple:
    """What makes a record 'the same experience' irrespective of its content bytes."""
    if r.kind == "rollout":
        return (r.kind, r.source_policy, r.version, r.prompt_id, r.sample_index)
    if r.kind == "group_outcome":
        return (r.kind, r.source_policy, r.version, r.prompt_id)
    return (r.kind, r.source_policy, r.version, r.prompt_id, r.completion)


def audit_exchange(db: Path, ack_log: Path | None, reference_ids: set[str] | None) -> dict[str, Any]:
    """Acknowledged vs stored records: lost, duplicated, and agreement with a reference run."""
    recs = exchange_records(db)
    ids = [r.record_id for r in recs]
    stored = set(ids)
    acked: set[str] = set()
    if ack_log is not None and ack_log.is_file():
        for line in ack_log.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a torn last line cannot be an ack
                acked.update(json.loads(line)["ids"])
    keys = collections.Counter(semantic_key(r) for r in recs)
    dup = (len(ids) - len(stored)) + sum(c - 1 for c in keys.values() if c > 1)
    out = {"records_stored": len(ids), "records_acknowledged": len(acked), "records_lost": len(acked - stored),
           "records_duplicated": dup}
    if reference_ids is not None:
        out["records_missing_vs_reference"] = len(reference_ids - stored)
        out["records_extra_vs_reference"] = len(stored - reference_ids)
    return out


def verify_all_checkpoints(run_dir: Path) -> tuple[int, int, list[str]]:
    """(complete checkpoints, unloadable ones, problems) of a run directory."""
    from mutualrl.run.checkpoint import CHECKPOINTS, read_state, step_of, verify_checkpoint

    n, bad, problems = 0, 0, []
    root = run_dir / CHECKPOINTS
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if step_of(d) is None:
            continue  # .tmp-/.old- leftovers are never read
        n += 1
        p = verify_checkpoint(d) if read_state(d) is not None else [f"{d}: incomplete step directory"]
        if p:
            bad += 1
            problems.extend(p)
    return n, bad, problems


# ----------------------------------------------------------------------------- kill trials
def _metric_lines(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines())
    except OSError:
        return 0


def launch(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, kill_after: Callable[[], float] | None,
           run_dir: Path, timeout: float = 900) -> tuple[int, bool]:
    """Run ``cmd``; with ``kill_after``, SIGKILL it that many seconds after it logged a new metric row.

    Returns (returncode, killed_from_outside).
    """
    with open(log, "ab") as fh:
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
        if kill_after is None:
            return p.wait(timeout=timeout), False
        n0 = _metric_lines(run_dir)
        t0 = time.time()
        while p.poll() is None and _metric_lines(run_dir) <= n0 and time.time() - t0 < timeout:
            time.sleep(0.05)
        if p.poll() is None:
            time.sleep(kill_after())
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            return p.wait(), True
        return p.wait(), False


def median_step_s(run_dir: Path) -> float:
    """The median wall time of one training step of a finished run (its ``metrics.jsonl``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    times = sorted(r["step_s"] for r in rows if isinstance(r.get("step_s"), (int, float)))
    return times[len(times) // 2] if times else 1.0


def kill_trials(work: Path, models: dict[str, Path], steps: int, plan: list[str], seed: int,
                reference: dict[str, Any]) -> dict[str, Any]:
    """One run, killed once per entry of ``plan`` and resumed each time; then audited.

    A ``random`` kill lands a uniform fraction of one step (the reference run's median step time)
    after the resumed process logs its first new metric row, so it falls inside the run wherever
    the machine's speed puts the steps (a fixed delay outlived a whole idle run)."""
    rng = random.Random(seed)
    step_s = reference["step_s"]
    run_dir = work / "killed_run"
    ack = work / "ack.jsonl"
    cfg_path = write_yaml(work / "kill.yaml", run_config(models, steps))
    log = work / "kill_trials.log"
    base = [sys.executable, "-m", "mutualrl.cli", "train"]
    trials, kills, resumed_ok, unloadable, problems = [], 0, 0, 0, []
    started = False
    for spec in plan:
        cmd = base + (["--resume", str(run_dir)] if started else [str(cfg_path), "-o", str(run_dir)]) + ["--no-progress"]
        env = subprocess_env(work, MUTUALRL_ACK_LOG=str(ack))
        t0 = time.time()
        if spec == "random":
            rc, outside = launch(cmd, env, work, log, lambda: rng.uniform(0.0, 1.0) * step_s, run_dir)
        else:
            env["MUTUALRL_FAULT_POINT"] = spec
            rc, outside = launch(cmd, env, work, log, None, run_dir)
        started = started or (run_dir / "config.yaml").is_file()
        killed = rc == -signal.SIGKILL
        n, bad, probs = verify_all_checkpoints(run_dir)
        from mutualrl.run.checkpoint import latest_checkpoint, read_state

        ck = latest_checkpoint(run_dir)
        trials.append({"kill": spec, "rc": rc, "killed": killed, "by": "outside" if outside else "self",
                       "checkpoints": n, "unloadable": bad, "wall_s": round(time.time() - t0, 1),
                       "resume_from_step": (read_state(ck) or {}).get("next_step", 0) if ck else 0})
        kills += int(killed)
        unloadable += bad
        problems += probs
        if rc not in (0, -signal.SIGKILL):
            problems.append(f"trial {spec}: exit code {rc} (see {log})")
        elif not killed:
            problems.append(f"trial {spec}: the process ended without being killed (the run had no work left)")
    # finish the run
    env = subprocess_env(work, MUTUALRL_ACK_LOG=str(ack))
    rc, _ = launch(base + ["--resume", str(run_dir), "--no-progress"], env, work, log, None, run_dir)
    completed = rc == 0 and (run_dir / "summary.json").is_file()
    n, bad, probs = verify_all_checkpoints(run_dir)
    unloadable += bad
    problems += probs
    diff, where = metric_max_diff(reference["metrics"], read_metrics(run_dir / "metrics.jsonl"))
    steps_done = max((k[0] for k in read_metrics(run_dir / "metrics.jsonl") if k[2] == "train"), default=-1) + 1
    audit = audit_exchange(run_dir / "exchange.db", ack, reference["ids"])
    # every kill counts as resumed when the final run completed every step and matches the reference
    resumed_ok = kills if (completed and steps_done == steps and diff <= 1e-6) else 0
    return {"trials": trials, "kill_trials": kills, "resumed_ok": resumed_ok, "completed": completed,
            "steps_completed": steps_done, "checkpoints_unloadable": unloadable, "problems": problems[:20],
            "resume_metric_max_diff": diff, "resume_metric_worst": where, **audit}


# ----------------------------------------------------------------------------- hostile peer
def hostile_check(work: Path, models: dict[str, Path], steps: int, per_kind: int) -> dict[str, Any]:
    """Publish hostile rows; check each is rejected or neutralised; train alongside them."""
    import threading

    from mutualrl.algorithms.sharing import OwnGroup, PeerRows, ShareContext, build_batch
    from mutualrl.config.resolve import load_config
    from mutualrl.exchange import open_exchange
    from mutualrl.experience import parse
    from mutualrl.run.worker import PolicyWorker

    cfg_d = run_config(models, steps, sharing={"strategy": "xgrpo+sgt"})
    cfg = load_config(cfg_d)
    learner = PolicyWorker(cfg, 0, None)  # policy "a": its limits, tokenizers and verifier
    peer_tok = next(iter(learner.peers.values())).tokenizer_id
    vocab = learner.limits.vocab_sizes[peer_tok]  # type: ignore[index]
    targets = [(p, s) for s in range(steps) for p in learner.task.sample_train(s, cfg.prompts_per_step)]
    rows = hostile_rows(targets, peer_tok, vocab, per_kind=per_kind, impersonate="b", foreign="evil")

    # 1) validation: every row judged on its own, counted by reason
    ex_path = work / "hostile_exchange.db"
    ex = open_exchange(f"sqlite:///{ex_path}", limits=learner.limits)
    by_reason: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    stored_lines = []
    half = len(rows) // 2
    for cat, line in rows[:half]:  # the first half before training, the rest alongside it
        res = ex.publish_json([line])
        outcome = "stored" if res.accepted else "duplicate" if res.duplicates else next(iter(res.rejected_by_reason))
        by_reason[outcome] += 1
        by_kind[cat][outcome] += 1
        if res.accepted:
            stored_lines.append((cat, line))

    # 2) the training run next to the hostile peer (the rest published by a thread meanwhile)
    def publish_rest() -> None:
        ex2 = open_exchange(f"sqlite:///{ex_path}", limits=learner.limits)
        for cat, line in rows[half:]:
            res = ex2.publish_json([line])
            outcome = "stored" if res.accepted else "duplicate" if res.duplicates else next(iter(res.rejected_by_reason))
            by_reason[outcome] += 1
            by_kind[cat][outcome] += 1
            if res.accepted:
                stored_lines.append((cat, line))
        ex2.close()

    th = threading.Thread(target=publish_rest)
    clean = train_in_process(cfg_d, work / "clean_run")
    th.start()
    hostile_cfg = dict(cfg_d, exchange=f"sqlite:///{ex_path}")
    dirty = train_in_process(hostile_cfg, work / "hostile_run")
    th.join()
    ex.close()

    # 3) every stored row: does any learner use its claim? (trust filter, then re-verification)
    used_claims, false_used, neutral_by = 0, 0, collections.Counter()
    # a byte-identical copy of a stored row (same content hash) adds nothing: counted, not stored
    neutral_by["duplicate_of_stored"] = by_reason.get("duplicate", 0)
    for cat, line in stored_lines:
        r = parse(line, learner.limits)
        if r.source_policy not in learner.peer_names:
            neutral_by["untrusted_source"] += 1
            continue
        prob = learner.task.get(r.prompt_id)
        assert prob is not None
        if r.kind == "verified_success":
            g = OwnGroup(prob, [1], [[1]] * 2, [[-1.0]] * 2, [0.0, 0.0], [0.0, 0.0])  # a failed group
            peers = PeerRows.from_records([r])
            ctx = ShareContext([g], peers, learner.options, cfg.sharing, learner.score,
                               learner.policy.encode_completion)
            batch = build_batch("sgt", ctx)
            n = sum(row.kind == "rescue" for row in batch.rows)
            ok = learner.task.is_success(learner.task.verify(prob, r.completion))
            if n and not ok:
                false_used += n
            if n:
                used_claims += 1
            else:
                neutral_by["sgt_reverification"] += 1
        else:  # impersonated rollouts / outcomes are not generated by this peer (see docs)
            used_claims += 1
    keep = ("reward_mean", "train_acc", "test_acc", "loss", "grad_norm", "sgt_rescue")
    ca = {(r["step"], r["policy"], r.get("event", "train")): {k: v for k, v in r.items() if k in keep} for r in clean}
    da = {(r["step"], r["policy"], r.get("event", "train")): {k: v for k, v in r.items() if k in keep} for r in dirty}
    diff, where = metric_max_diff(ca, da)
    finals = {}
    for name, hist in (("clean", clean), ("hostile", dirty)):
        ev = [r for r in hist if r.get("event") == "eval" and r["step"] == steps]
        tr = [r["reward_mean"] for r in hist if r.get("event") is None and "reward_mean" in r]
        finals[name] = {"test_acc_final": sum(r["test_acc"] for r in ev) / max(1, len(ev)),
                        "train_reward_mean": sum(tr) / max(1, len(tr))}
    untrusted_seen = sum(r.get("peer_rows_untrusted", 0) for r in dirty)
    sgt_refused = sum(r.get("sgt_refused", 0) for r in dirty) - sum(r.get("sgt_refused", 0) for r in clean)
    rejected = sum(v for k, v in by_reason.items() if k not in ("stored", "duplicate"))
    assert rejected + len(stored_lines) + by_reason.get("duplicate", 0) == len(rows)
    learner.close()
    return {
        "hostile_rows": len(rows), "hostile_rejected": rejected, "hostile_stored": len(stored_lines),
        "hostile_duplicates": by_reason.get("duplicate", 0),
        "hostile_neutralised": sum(neutral_by.values()), "hostile_neutralised_by": dict(neutral_by),
        "hostile_accepted": used_claims, "false_successes_used": false_used,
        "hostile_by_reason": dict(by_reason), "hostile_by_kind": {k: dict(v) for k, v in by_kind.items()},
        "hostile_run_untrusted_rows_ignored": untrusted_seen, "hostile_run_sgt_refused_extra": sgt_refused,
        "hostile_run_metric_max_diff": diff, "hostile_run_metric_worst": where, "hostile_run_finals": finals,
    }


# ----------------------------------------------------------------------------- bad input
def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every path under ``root`` (directories included)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size if n in files else -1, st.st_mtime_ns)
    return out


def bad_input_cases(models: dict[str, Path]) -> list[tuple[str, Callable[[Path], list[str]]]]:
    """(name, setup(dir) -> CLI argv) for bad CLI/config input; each must exit 2 and write nothing."""
    good = run_config(models, 2)
    good["task"] = {"preset": "zoo", "test_size": 24}

    def cfg(name: str, mutate: Callable[[dict], Any], *flags: str) -> Callable[[Path], list[str]]:
        def setup(d: Path) -> list[str]:
            data = json.loads(json.dumps(good))
            mutate(data)
            write_yaml(d / f"{name}.yaml", data)
            return ["train", f"{name}.yaml", "-o", f"runs/{name}", "--no-progress", *flags]
        return setup

    def jsonl(name: str, content: bytes) -> Callable[[Path], list[str]]:
        def setup(d: Path) -> list[str]:
            (d / f"{name}.jsonl").write_bytes(content)
            return cfg(name, lambda c: c.__setitem__("task", {"datasets": [{"path": f"{name}.jsonl"}],
                                                              "test_size": 4}))(d)
        return setup

    def raw(name: str, text: str) -> Callable[[Path], list[str]]:
        def setup(d: Path) -> list[str]:
            (d / f"{name}.yaml").write_text(text)
            return ["train", f"{name}.yaml", "-o", f"runs/{name}", "--no-progress"]
        return setup

    def empty_run_dir(d: Path) -> list[str]:
        (d / "not_a_run").mkdir(exist_ok=True)
        (d / "not_a_run" / "notes.txt").write_text("hello\n")
        return ["train", "--resume", "not_a_run", "--no-progress"]

    def existing_dir(d: Path) -> list[str]:
        (d / "busy").mkdir(exist_ok=True)
        (d / "busy" / "keep.txt").write_text("mine\n")
        return cfg("existing", lambda c: None)(d)[:2] + ["-o", "busy", "--no-progress"]

    def no_model_dir(d: Path) -> list[str]:
        (d / "empty_model").mkdir(exist_ok=True)
        return cfg("no_config_json", lambda c: c["policies"][0].__setitem__("model", "./empty_model"))(d)

    return [
        ("unknown field", cfg("unknown_field", lambda c: c.__setitem__("stepz", 5))),
        ("unknown nested field", cfg("unknown_nested", lambda c: c["grpo"].__setitem__("num_generation", 4))),
        ("wrong type", cfg("wrong_type", lambda c: c.__setitem__("steps", "ten"))),
        ("negative steps (config)", cfg("neg_steps", lambda c: c.__setitem__("steps", -3))),
        ("negative --steps", cfg("neg_flag", lambda c: None, "--steps", "-1")),
        ("num_generations 1", cfg("one_gen", lambda c: c["grpo"].__setitem__("num_generations", 1))),
        ("missing model dir", cfg("missing_model", lambda c: c["policies"][0].__setitem__("model", "/nonexistent/m"))),
        ("model dir without config.json", no_model_dir),
        ("unloadable model id", cfg("bad_hub", lambda c: c["policies"][1].__setitem__("model", "nobody/no-such-model"))),
        ("unreadable JSONL (bad JSON)", jsonl("badjson", b'{"question": "1+1", "answer": "2"}\n{not json\n')),
        ("unreadable JSONL (not UTF-8)", jsonl("binary", b"\xff\xfe\x00\x81garbage\n")),
        ("JSONL without answer column", jsonl("nocol", b'{"question": "1+1", "result": "2"}\n')),
        ("missing JSONL file", cfg("nofile", lambda c: c.__setitem__("task", {"datasets": [{"path": "nope.jsonl"}]}))),
        ("unknown reasoning-gym dataset", cfg("bad_gym", lambda c: c.__setitem__(
            "task", {"datasets": [{"name": "basic_arithmetik"}]}))),
        ("strategy typo", cfg("typo", lambda c: c["sharing"].__setitem__("strategy", "sgtt"))),
        ("invalid strategy combination", cfg("combo", lambda c: None, "--strategy", "prp+xgrpo")),
        ("loss_type typo", cfg("loss", lambda c: c["grpo"].__setitem__("loss_type", "drgrpo"))),
        ("duplicate policy names", cfg("dup", lambda c: c["policies"][1].__setitem__("name", "a"))),
        ("unknown exchange scheme", cfg("exch", lambda c: c.__setitem__("exchange", "postgres://x"))),
        ("config file missing", lambda d: ["train", "missing.yaml", "-o", "runs/x", "--no-progress"]),
        ("invalid YAML", raw("badyaml", "policies: [\n  - {name: a\nsteps: : 3\n")),
        ("config not a mapping", raw("alist", "- 1\n- 2\n")),
        ("resume of a non-run directory", empty_run_dir),
        ("resume of a missing directory", lambda d: ["train", "--resume", "no_such_run", "--no-progress"]),
        ("existing run dir without --resume", existing_dir),
    ]


def check_bad_inputs(work: Path, models: dict[str, Path], subprocesses: bool) -> dict[str, Any]:
    """Run each bad-input case in a fresh directory; exit code, message and disk snapshot."""
    results = []
    for name, setup in bad_input_cases(models):
        d = Path(tempfile.mkdtemp(prefix="bad-", dir=work))
        argv = setup(d)
        before = snapshot(d)
        if subprocesses:
            p = subprocess.run([sys.executable, "-m", "mutualrl.cli", *argv], cwd=d, env=subprocess_env(work),
                               capture_output=True, text=True, timeout=300, check=False)
            rc, err = p.returncode, p.stderr
        else:
            rc, err = run_cli_here(argv, d)
        after = snapshot(d)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        msg = lines[-1] if lines else ""
        clean = rc == 2 and before == after and len(lines) == 1 and msg.startswith("mutualrl: error:")
        results.append({"case": name, "rc": rc, "message": msg[:300], "disk_unchanged": before == after,
                        "one_line": len(lines) == 1, "clean": clean})
        shutil.rmtree(d, ignore_errors=True)
    return {"bad_inputs": len(results), "bad_inputs_clean": sum(r["clean"] for r in results), "cases": results}


def run_cli_here(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``mutualrl.cli.main(argv)`` in this process with ``cwd`` as working directory."""
    import io

    from mutualrl.cli import main

    err = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse errors
                rc = int(exc.code or 0)
    finally:
        os.chdir(old)
    return rc, err.getvalue()


# ----------------------------------------------------------------------------- disk full / lock
@contextlib.contextmanager
def tiny_tmpfs(path: Path, size_kib: int) -> Iterator[bool]:
    """Mount a tmpfs of ``size_kib`` on ``path`` if we may (root); yields whether it is mounted."""
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                        capture_output=True, check=False).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def disk_full_check(work: Path, models: dict[str, Path]) -> dict[str, Any]:
    """A run whose checkpoint cannot be written (full disk): clear error, last good one intact."""
    from mutualrl.run.checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint
    from mutualrl.run.trainer import MutualTrainer
    from mutualrl.run.worker import PolicyWorker

    out: dict[str, Any] = {}
    cfg = run_config(models, 6, exchange=f"sqlite:///{work / 'diskfull_exchange.db'}")
    # how big is one checkpoint of this run?
    probe = work / "probe_run"
    train_in_process(dict(cfg, steps=2, exchange="memory://"), probe)
    ck = latest_checkpoint(probe)
    ck_kib = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file()) // 1024 + 1 if ck else 512
    mnt = work / "tmpfs"
    with tiny_tmpfs(mnt, int(ck_kib * 2.6) + 64) as mounted:
        method = "tmpfs" if mounted else "injected ENOSPC"
        run = mnt / "run"
        orig = PolicyWorker.save
        calls = {"n": 0}

        def full_disk_save(self: Any, directory: Any) -> None:
            calls["n"] += 1
            if calls["n"] > 4:  # the third checkpoint (2 policies each)
                raise OSError(errno.ENOSPC, "No space left on device")
            orig(self, directory)

        if not mounted:
            PolicyWorker.save = full_disk_save  # type: ignore[method-assign]
        try:
            tr = MutualTrainer(cfg, run, progress=False)
            tr.train()
            out["error"] = None
        except CheckpointError as exc:
            out["error"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - report what the user would see
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            PolicyWorker.save = orig  # type: ignore[method-assign]
        last = latest_checkpoint(run)
        out.update({"method": method, "checkpoint_kib": ck_kib,
                    "clear_error": bool(out["error"]) and "last good checkpoint" in out["error"],
                    "last_good": str(last.name) if last else None,
                    "last_good_loads": bool(last) and not verify_checkpoint(last),
                    "leftover_tmp": bool(last) and any(p.name.startswith(".tmp-") for p in last.parent.iterdir())})
    return out


def locked_exchange_check(work: Path, models: dict[str, Path],
                          cases: tuple[str, ...] = ("locked", "not_a_database")) -> dict[str, Any]:
    """An exchange locked by another process, and one that is not a database: exit 2, nothing written."""
    out: dict[str, Any] = {}
    if "locked" in cases:
        out.update(_locked(work, models))
    if "not_a_database" in cases:
        out.update(_not_a_database(work, models))
    return out


def _locked(work: Path, models: dict[str, Path]) -> dict[str, Any]:
    out = {}
    db = work / "locked.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA journal_mode = WAL")
    holder.execute("CREATE TABLE IF NOT EXISTS x(a)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        d = Path(tempfile.mkdtemp(prefix="lock-", dir=work))
        write_yaml(d / "c.yaml", run_config(models, 2, exchange=f"sqlite:///{db}?busy_timeout_s=1"))
        before = snapshot(d)
        rc, err = run_cli_here(["train", "c.yaml", "-o", "run", "--no-progress"], d)
        out["locked"] = {"rc": rc, "message": err.strip().splitlines()[-1][:300] if err.strip() else "",
                         "disk_unchanged": before == snapshot(d)}
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    return out


def _not_a_database(work: Path, models: dict[str, Path]) -> dict[str, Any]:
    out = {}
    notdb = work / "garbage.db"
    notdb.write_bytes(b"this is not a database" * 100)
    d = Path(tempfile.mkdtemp(prefix="notdb-", dir=work))
    write_yaml(d / "c.yaml", run_config(models, 2, exchange=f"sqlite:///{notdb}"))
    before = snapshot(d)
    rc, err = run_cli_here(["train", "c.yaml", "-o", "run", "--no-progress"], d)
    out["not_a_database"] = {"rc": rc, "message": err.strip().splitlines()[-1][:300] if err.strip() else "",
                             "disk_unchanged": before == snapshot(d)}
    return out


# ----------------------------------------------------------------------------- main
def machine() -> dict[str, Any]:
    import torch

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=False).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer kills; bad input checked in-process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults.json"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="mutualrl-faults-"))
    (work / "faults_reward.py").write_text(REWARD_MODULE)
    load_reward_module(work / "faults_reward.py")
    from mutualrl.zoo import build_tiny_models

    models = build_tiny_models(work / "models")
    # enough steps that every trial of the plan still finds work to kill: a kill rolls the run back
    # to its last checkpoint, but a fault point that fires late (update:9) moves it ~4 steps on
    steps = 10 if args.quick else 24
    rng = random.Random(args.seed)
    points = ["update:3", "publish:4", "checkpoint_write:2", "rollout:5", "checkpoint_commit:1", "published:3"]
    plan = points[:4] + ["random"] if args.quick else points + ["random", "random", "update:9", "random"]
    rng.shuffle(plan)

    print(f"work dir: {work}")
    result: dict[str, Any] = {"quick": args.quick, "seed": args.seed, "steps": steps, "kill_plan": plan}
    # reference (uninterrupted) run in this process
    ref_dir = work / "reference_run"
    train_in_process(run_config(models, steps), ref_dir)
    reference = {"metrics": read_metrics(ref_dir / "metrics.jsonl"), "step_s": median_step_s(ref_dir),
                 "ids": {r.record_id for r in exchange_records(ref_dir / "exchange.db")}}
    print("reference run done", f"{time.perf_counter() - t0:.0f}s")
    kt = kill_trials(work, models, steps, plan, args.seed, reference)
    print("kill trials done", f"{time.perf_counter() - t0:.0f}s")
    hostile = hostile_check(work, models, 6 if args.quick else 8, per_kind=90 if args.quick else 100)
    print("hostile peer done", f"{time.perf_counter() - t0:.0f}s")
    bad = check_bad_inputs(work, models, subprocesses=not args.quick)
    print("bad inputs done", f"{time.perf_counter() - t0:.0f}s")
    disk = disk_full_check(work, models)
    lock = locked_exchange_check(work, models)
    result.update({
        "kill_trials": kt["kill_trials"], "resumed_ok": kt["resumed_ok"],
        "records_acknowledged": kt["records_acknowledged"], "records_lost": kt["records_lost"],
        "records_duplicated": kt["records_duplicated"], "checkpoints_unloadable": kt["checkpoints_unloadable"],
        "hostile_rows": hostile["hostile_rows"], "hostile_accepted": hostile["hostile_accepted"],
        "false_successes_used": hostile["false_successes_used"],
        "bad_inputs": bad["bad_inputs"], "bad_inputs_clean": bad["bad_inputs_clean"],
        "resume_metric_max_diff": kt["resume_metric_max_diff"],
        "resume_tolerance": 1e-6,
        "kill_detail": kt, "hostile_detail": hostile, "bad_input_detail": bad["cases"],
        "disk_full": disk, "exchange_open_errors": lock,
        "machine": machine(), "wall_s": round(time.perf_counter() - t0, 1), "git_rev": git_rev(),
    })
    print()
    print(f"{'kill trials':<28}{kt['kill_trials']:>8}   resumed ok {kt['resumed_ok']}, all steps done: "
          f"{kt['steps_completed']}/{steps}")
    for t in kt["trials"]:
        print(f"  {t['kill']:<22} rc={t['rc']:<5} by={t['by']:<8} resume from step {t['resume_from_step']:<3} "
              f"checkpoints={t['checkpoints']} unloadable={t['unloadable']}")
    print(f"{'records acknowledged':<28}{kt['records_acknowledged']:>8}   lost {kt['records_lost']}, duplicated "
          f"{kt['records_duplicated']}, vs reference missing {kt['records_missing_vs_reference']} extra "
          f"{kt['records_extra_vs_reference']}")
    print(f"{'checkpoints unloadable':<28}{kt['checkpoints_unloadable']:>8}")
    print(f"{'resume metric max diff':<28}{kt['resume_metric_max_diff']:>8.2g}   ({kt['resume_metric_worst']})")
    print(f"{'hostile rows':<28}{hostile['hostile_rows']:>8}   rejected {hostile['hostile_rejected']}, stored "
          f"{hostile['hostile_stored']} + {hostile['hostile_duplicates']} duplicates (neutralised "
          f"{hostile['hostile_neutralised']}: {hostile['hostile_neutralised_by']}), accepted "
          f"{hostile['hostile_accepted']}, false successes used {hostile['false_successes_used']}")
    print(f"{'':<28}{'':>8}   by reason {hostile['hostile_by_reason']}")
    print(f"{'':<28}{'':>8}   run alongside: metric max diff vs clean {hostile['hostile_run_metric_max_diff']:.2g}")
    print(f"{'bad inputs':<28}{bad['bad_inputs']:>8}   clean {bad['bad_inputs_clean']}")
    for c in bad["cases"]:
        print(f"  {'ok ' if c['clean'] else 'BAD'} {c['case']:<36} rc={c['rc']} {c['message'][:90]}")
    print(f"{'disk full':<28}{disk['method']:>8}   clear error {disk['clear_error']}, last good "
          f"{disk['last_good']} loads {disk['last_good_loads']}")
    print(f"  {disk['error']}")
    for k, v in lock.items():
        print(f"{'exchange ' + k:<28}{v['rc']:>8}   {v['message'][:100]}  unchanged={v['disk_unchanged']}")
    print(f"wall {result['wall_s']}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
