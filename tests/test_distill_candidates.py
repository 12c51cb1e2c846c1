"""benchmarks/distill_candidates.py on synthetic tuning records: each single-model family's best on
validation (the strongest marked), the best imitate-with-replay arm without distill, every distill
candidate; per policy and type, with FLOPs split by phase."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest


def record(arm: str, strategy: str, val: dict[str, dict[str, float]], scoring: float = 0.0) -> dict:
    steps = [{"policy": p, "step": 0, "train_tokens": 10, "optimizer_steps": 1, "gen_tokens": 5,
              "flops_sampling": 1.0, "flops_scoring": scoring, "flops_update": 2.0} for p in val]
    evals = [{"policy": p, "step": s, "val_acc": v["val"] * (s / 300),
              **{f"val_acc/{t}": x for t, x in v.items() if t != "val"}} for p, v in val.items() for s in (0, 300)]
    return {"arm": arm, "strategy": strategy, "seed": 0, "git_rev": "r", "policies": list(val), "evals": evals,
            "steps": steps}


def acc(x: float) -> dict[str, dict[str, float]]:
    return {"a": {"val": x, "add": x + 0.1, "sub": x - 0.1}, "b": {"val": x, "add": x - 0.1, "sub": x + 0.1}}


@pytest.fixture
def dc(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("distill_candidates")


def test_the_table_holds_each_familys_best_the_best_replay_and_every_distill_candidate(dc):
    runs = [record("independent", "independent", acc(0.50)), record("independent_lr3e-4", "independent", acc(0.55)),
            record("self_imitate_lr1e-4", "self_imitate", acc(0.60)),
            record("matched_lr3e-4_replay4", "self_imitate", acc(0.58)),
            record("imitate_replay4", "imitate", acc(0.70)), record("imitate_replay4_lr5e-4", "imitate", acc(0.68)),
            record("imitate_lr3e-4", "imitate", acc(0.75)),
            record("distill", "distill", acc(0.52), scoring=0.5),
            record("imitate_replay4+distill", "imitate+distill", acc(0.72), scoring=0.5)]
    rows = dc.candidates(runs)
    assert [r["arm"] for r in rows] == ["independent_lr3e-4", "self_imitate_lr1e-4", "matched_lr3e-4_replay4",
                                        "imitate_replay4", "distill", "imitate_replay4+distill"]
    assert rows[1]["kind"].endswith("the strongest single-model arm")
    assert sum("strongest" in r["kind"] for r in rows) == 1
    last = rows[-1]
    assert last["val"] == pytest.approx(0.72) and last["per_policy"]["a"]["val"]["add"] == pytest.approx(0.82)
    assert last["per_policy"]["b"]["flops"] == {"sampling": 1.0, "scoring": 0.5, "update": 2.0}
    md = dc.markdown(rows)
    assert md.count("\n") == len(rows) + 1 and "a: add / sub" in md and "72.0 %" in md


def test_no_distill_candidate_exits_2(dc, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(dc, "RESULTS", tmp_path)
    assert dc.main(["--study", "nothing"]) == 2
    assert "no distill candidate" in capsys.readouterr().err
