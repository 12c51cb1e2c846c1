"""Reliability and safety: atomic checkpoints, kill -9 + exact resume, hostile peers, bad input,
full disk, locked exchange, failing reward functions (the short form of benchmarks/faults.py)."""

from __future__ import annotations

import errno
import importlib.util
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    """benchmarks/faults.py as a module (its helpers are shared with these tests)."""
    mod = sys.modules.get("mutualrl_bench_faults")
    if mod is None:
        spec = importlib.util.spec_from_file_location("mutualrl_bench_faults", ROOT / "benchmarks" / "faults.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules["mutualrl_bench_faults"] = mod
        folder = str(ROOT / "benchmarks")
        sys.path.insert(0, folder)  # as `python benchmarks/faults.py` has it: its helpers (_hostile) import by name
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.path.remove(folder)
    return mod


@pytest.fixture()
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory with ``faults_reward.py`` (a dense reward) on sys.path and PYTHONPATH."""
    d = tmp_path / "pymods"
    d.mkdir()
    (d / "faults_reward.py").write_text(_bench().REWARD_MODULE)
    (d / "bad_rewards.py").write_text(
        "import math, time\n"
        "def raises(prompts, completions, **kw):\n    raise RuntimeError('boom')\n"
        "def nan(prompts, completions, **kw):\n    return [math.nan] * len(completions)\n"
        "def hangs(prompts, completions, **kw):\n    time.sleep(30)\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(d))
    return d


# ----------------------------------------------------------------------------- static safety
def test_peer_data_paths_never_execute_or_unpickle() -> None:
    """No module that touches peer data imports pickle/marshal/dill or calls eval/exec/unsafe loaders."""
    files = sorted((ROOT / "mutualrl" / "exchange").glob("*.py")) + sorted(
        (ROOT / "mutualrl" / "experience").glob("*.py")) + sorted(
        (ROOT / "mutualrl" / "algorithms" / "strategies").glob("*.py")) + [
        ROOT / "mutualrl" / "thl" / "peer.py", ROOT / "mutualrl" / "algorithms" / "sharing.py"]
    banned = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|marshal|dill|cloudpickle|shelve)\b|"
                        r"(?<![\w.])(eval|exec|compile|__import__)\s*\(|pickle\.loads?\(|yaml\.load\(|"
                        r"torch\.load\(|numpy\.load\(|allow_pickle\s*=\s*True", re.MULTILINE)
    hits = []
    for f in files:
        for m in banned.finditer(f.read_text(encoding="utf-8")):
            hits.append(f"{f.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not hits, hits
    assert len(files) >= 14


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_manager_atomic_prune_and_fallback(tmp_path: Path) -> None:
    from mutualrl.run.checkpoint import (
        CheckpointError,
        CheckpointManager,
        latest_checkpoint,
        list_checkpoints,
    )

    mgr = CheckpointManager(tmp_path, keep=2)

    def writer(payload: bytes):
        def write(tmp: Path) -> list[str]:
            (tmp / "p").mkdir()
            (tmp / "p" / "blob.bin").write_bytes(payload)
            return ["p"]
        return write

    for step in (2, 4, 6):
        mgr.save(step, writer(b"x" * step), {"exchange_position": step * 10})
    assert [d.name for d in list_checkpoints(tmp_path)] == ["step_000004", "step_000006"]
    assert (tmp_path / "checkpoints" / "LATEST").read_text().strip() == "step_000006"

    def full_disk(tmp: Path) -> list[str]:
        (tmp / "p").mkdir()
        (tmp / "p" / "blob.bin").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="disk is full.*last good checkpoint.*step_000006"):
        mgr.save(8, full_disk, {"exchange_position": 80})
    assert latest_checkpoint(tmp_path).name == "step_000006"
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "checkpoints").iterdir())
    # a file that lost bytes after the fact: that checkpoint is no longer "good", the previous one is
    blob = tmp_path / "checkpoints" / "step_000006" / "p" / "blob.bin"
    blob.write_bytes(b"x")
    assert latest_checkpoint(tmp_path).name == "step_000004"
    # a half-written temp directory from a crash is never read and is cleaned on the next save
    (tmp_path / "checkpoints" / ".tmp-step_000010").mkdir()
    mgr.save(10, writer(b"y"), {"exchange_position": 100})
    assert not (tmp_path / "checkpoints" / ".tmp-step_000010").exists()
    assert latest_checkpoint(tmp_path).name == "step_000010"


# ----------------------------------------------------------------------------- crash + exact resume
def test_kill9_at_fault_points_then_exact_resume(tiny_models: dict[str, Path], reward_module: Path,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed (a real ``python -m mutualrl.cli train`` process) in the middle of writing its second
    checkpoint, two steps after the first, then resumed: same metrics as an uninterrupted run, the
    same exchange contents (every acknowledged record exactly once), every checkpoint loads.
    ``benchmarks/faults.py`` does the same at every fault point and at random moments."""
    B = _bench()
    from mutualrl.run.trainer import MutualTrainer

    steps = 4  # checkpoints at 2 and 4; killed while writing the one at 4
    cfg = B.run_config(tiny_models, steps)
    ref = tmp_path / "ref"
    B.train_in_process(cfg, ref)
    ref_metrics = B.read_metrics(ref / "metrics.jsonl")
    ref_ids = {r.record_id for r in B.exchange_records(ref / "exchange.db")}

    run = tmp_path / "run"
    ack = tmp_path / "ack.jsonl"
    cfg_path = B.write_yaml(tmp_path / "c.yaml", cfg)
    base = [sys.executable, "-m", "mutualrl.cli", "train"]
    log = tmp_path / "log.txt"
    cmd = base + [str(cfg_path), "-o", str(run), "--no-progress"]
    env = B.subprocess_env(reward_module, MUTUALRL_ACK_LOG=str(ack), MUTUALRL_FAULT_POINT="checkpoint_write:2")
    rc, _ = B.launch(cmd, env, tmp_path, log, None, run, timeout=300)
    assert rc == -signal.SIGKILL, log.read_text()[-3000:]
    n, bad, problems = B.verify_all_checkpoints(run)
    assert n == 1 and bad == 0, problems
    assert any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())  # died mid-write
    assert len(B.exchange_records(run / "exchange.db")) > len(ref_ids) // 3  # steps 2-3 published, to be redone
    monkeypatch.setenv("MUTUALRL_ACK_LOG", str(ack))
    MutualTrainer(cfg, run, resume=True, progress=False).train()

    diff, where = B.metric_max_diff(ref_metrics, B.read_metrics(run / "metrics.jsonl"))
    assert diff <= 1e-6, where
    audit = B.audit_exchange(run / "exchange.db", ack, ref_ids)
    assert audit["records_acknowledged"] > 0
    assert audit["records_lost"] == 0 and audit["records_duplicated"] == 0, audit
    assert audit["records_missing_vs_reference"] == 0 and audit["records_extra_vs_reference"] == 0, audit
    n, bad, problems = B.verify_all_checkpoints(run)
    assert n == 2 and bad == 0, problems  # keep the last 2
    assert not any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())


# ----------------------------------------------------------------------------- hostile peer
def test_hostile_peer_rows_rejected_or_neutralised(tiny_models: dict[str, Path]) -> None:
    from collections import Counter

    from transformers import AutoTokenizer

    from mutualrl.algorithms.sharing import OwnGroup, PeerRows, ShareContext, build_batch
    from mutualrl.config import GRPOOptions
    from mutualrl.exchange import open_exchange
    from mutualrl.experience import ExperienceLimits
    from mutualrl.rollout.modeling import tokenizer_fingerprint
    from mutualrl.zoo import default_task

    hostile_rows = _bench().hostile_rows

    task = default_task(seed=0, test_size=40, train_size=400)
    tok = AutoTokenizer.from_pretrained(tiny_models["tiny-llama"])
    tid = tokenizer_fingerprint(tok)
    limits = ExperienceLimits(reward_range=task.reward_range, vocab_sizes={tid: len(tok)},
                              known_prompt_ids=frozenset(task.known_ids()))
    targets = [(p, s) for s in range(3) for p in task.sample_train(s, 4)]
    rows = hostile_rows(targets, tid, len(tok), per_kind=90)
    assert len(rows) >= 1000
    ex = open_exchange("memory://", limits=limits)
    outcome: Counter[tuple[str, str]] = Counter()
    stored = []
    for cat, line in rows:
        res = ex.publish_json([line])
        why = "stored" if res.accepted else "duplicate" if res.duplicates else next(iter(res.rejected_by_reason))
        outcome[(cat, why)] += 1
        if res.accepted:
            stored.append(cat)
    expected = {"over_cap_text": "too_large", "invalid_utf8": "invalid_utf8", "non_finite_logprob": "non_finite",
                "token_out_of_vocab": "token_range", "logprob_length": "length_mismatch",
                "unknown_prompt": "unknown_prompt", "duplicate_id": "bad_id", "reward_out_of_range": "reward_range"}
    for cat, reason in expected.items():
        assert outcome[(cat, reason)] == 90, (cat, {k: v for k, v in outcome.items() if k[0] == cat})
    assert set(stored) <= {"false_success", "false_reward", "false_outcome", "prompt_injection"}
    # the stored rows: foreign sources are dropped by the learner's trust filter (worker.update);
    # impersonated successes (wrong answers, injection text) are refused by SGT's re-verification
    by_prompt = {p.id: p for p, _ in targets}
    recs = [r for r in ex.query(list(by_prompt)) if r.source_policy == "b"]
    assert recs and {r.kind for r in recs} == {"verified_success"}
    rescued = 0
    for r in recs:
        prob = by_prompt[r.prompt_id]
        g = OwnGroup(prob, [1], [[1], [1]], [[-1.0], [-1.0]], [0.0, 0.0], [0.0, 0.0])
        ctx = ShareContext([g], PeerRows.from_records([r]), GRPOOptions(num_generations=2),
                           lambda ps, cs: task.rewards(ps, [p.question for p in ps], cs), lambda prompt, text: [1, 2])
        batch = build_batch("sgt", ctx)
        rescued += sum(row.kind == "rescue" for row in batch.rows)
        assert batch.metrics["sgt_refused"] == 1
    assert rescued == 0


def test_training_next_to_hostile_peer_is_unaffected(tiny_models: dict[str, Path], reward_module: Path,
                                                    tmp_path: Path) -> None:
    """A run whose exchange holds hostile rows for its own prompts learns exactly like a clean run."""
    B = _bench()
    from mutualrl.exchange import open_exchange
    hostile_rows = B.hostile_rows
    from mutualrl.config.resolve import load_config
    from mutualrl.run.worker import PolicyWorker

    cfg = B.run_config(tiny_models, 2, eval_every=2)
    w = PolicyWorker(load_config(cfg), 0, None)
    peer_tok = next(iter(w.peers.values())).tokenizer_id
    targets = [(p, s) for s in range(2) for p in w.task.sample_train(s, 4)]
    db = tmp_path / "shared.db"
    ex = open_exchange(f"sqlite:///{db}", limits=w.limits)
    res = ex.publish_json(line for _, line in hostile_rows(targets, peer_tok, w.limits.vocab_sizes[peer_tok],
                                                           per_kind=10))
    ex.close()
    w.close()
    assert res.accepted > 0 and res.rejected > 0
    clean = B.train_in_process(cfg, tmp_path / "clean")
    dirty = B.train_in_process(dict(cfg, exchange=f"sqlite:///{db}"), tmp_path / "dirty")
    keep = ("reward_mean", "train_acc", "test_acc", "loss", "grad_norm", "sgt_rescue")

    def view(hist: list[dict]) -> dict:
        return {(r["step"], r["policy"], r.get("event", "train")): {k: v for k, v in r.items() if k in keep}
                for r in hist}

    diff, where = B.metric_max_diff(view(clean), view(dirty))
    assert diff == 0.0, where
    assert sum(r.get("peer_rows_untrusted", 0) for r in dirty) > 0
    assert sum(r.get("sgt_refused", 0) for r in dirty) > sum(r.get("sgt_refused", 0) for r in clean)


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_exit_2_one_message_nothing_written(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    B = _bench()
    res = B.check_bad_inputs(tmp_path, tiny_models, subprocesses=False)
    assert res["bad_inputs"] >= 15
    bad = [c for c in res["cases"] if not c["clean"]]
    assert not bad, json.dumps(bad, indent=1)


def test_full_disk_and_unusable_exchange(tiny_models: dict[str, Path], reward_module: Path,
                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    B = _bench()
    from mutualrl.cli import main
    from mutualrl.run.checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint
    from mutualrl.run.worker import PolicyWorker

    orig = PolicyWorker.save
    calls = {"n": 0}

    def full_disk(self: Any, directory: Any) -> None:
        calls["n"] += 1
        if calls["n"] > 2:  # the second checkpoint (2 policies each) hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        orig(self, directory)

    monkeypatch.setattr(PolicyWorker, "save", full_disk)
    cfg_path = B.write_yaml(tmp_path / "c.yaml", B.run_config(tiny_models, 4))
    run = tmp_path / "run"
    from mutualrl.run.trainer import MutualTrainer

    with pytest.raises(CheckpointError, match="disk is full.*last good checkpoint.*step_000002"):
        MutualTrainer(B.run_config(tiny_models, 4), run, progress=False).train()
    last = latest_checkpoint(run)
    assert last is not None and last.name == "step_000002" and verify_checkpoint(last) == []
    assert not any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())
    # the CLI turns it into one line and exit 1 (not bad input, but not a traceback either)
    calls["n"] = 2
    assert main(["train", "--resume", str(run), "--no-progress"]) == 1
    assert latest_checkpoint(run).name == "step_000002"
    monkeypatch.setattr(PolicyWorker, "save", orig)
    del cfg_path
    lock = B.locked_exchange_check(tmp_path, tiny_models, cases=("locked",))
    assert lock["locked"]["rc"] == 2 and lock["locked"]["disk_unchanged"], lock
    assert "locked" in lock["locked"]["message"]


# ----------------------------------------------------------------------------- reward functions
def test_failing_reward_functions_give_zero_and_are_counted(tiny_models: dict[str, Path], reward_module: Path,
                                                           tmp_path: Path) -> None:
    B = _bench()
    cfg = B.run_config(tiny_models, 2, eval_every=2)
    cfg["task"] = {"preset": "zoo", "test_size": 24, "reward_timeout_s": 0.3,
                   "reward_functions": ["bad_rewards:raises", "bad_rewards:nan", "bad_rewards:hangs"]}
    hist = B.train_in_process(cfg, tmp_path / "run")
    rows = [r for r in hist if r.get("event") is None and "reward_mean" in r]
    assert len(rows) == 4  # 2 steps x 2 policies: the run went on
    last = {r["policy"]: r for r in rows if r["step"] == 1}
    for r in last.values():
        assert r["reward_fn_raised"] > 0 and r["reward_fn_non_finite"] > 0 and r["reward_fn_timed_out"] > 0
        assert 0.0 <= r["reward_mean"] <= 1.0


def test_tied_embedding_checkpoint_round_trips_strictly(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The Llama zoo family ties its LM head to the embedding: the file holds the storage once, a
    strict load restores every weight with the tie intact, and a file missing a key is refused."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from mutualrl.run.checkpoint import CheckpointError, load_module, save_module, tied_aliases

    model = AutoModelForCausalLM.from_pretrained(tiny_models["tiny-llama"])
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    keys = save_module(model, tmp_path / "m.safetensors")
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    fresh = AutoModelForCausalLM.from_pretrained(tiny_models["tiny-llama"])
    load_module(fresh, tmp_path / "m.safetensors")
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    sd = load_file(tmp_path / "m.safetensors")
    sd.pop("model.norm.weight")
    save_file(sd, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_module(fresh, tmp_path / "broken.safetensors")
