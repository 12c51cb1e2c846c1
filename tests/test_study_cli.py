"""``mutualrl study STUDY.yaml``: a two-arm, two-seed study on the shipped zoo through the command,
re-aggregated from its records; tuning on validation; bad study files refused before anything is
written."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from mutualrl.cli import main
from mutualrl.study.aggregate import AGGREGATE_KEYS
from mutualrl.study.command import planned_runs, run_study
from mutualrl.study.harness import Arm, Study
from mutualrl.study.records import load_records, write_record
from mutualrl.study.spec import load_study, parse_study

BASE = {
    "policies": [{"name": "g", "model": "zoo:gpt2-add"}, {"name": "l", "model": "zoo:llama-sub"}],
    "task": {"preset": "zoo", "test_size": 16, "val_size": 16, "train_size": 200},
    "grpo": {"num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-3, "dynamic_sampling": "off"},
    "steps": 2, "prompts_per_step": 4, "eval_every": 2, "eval_size": 16, "checkpoint_every": 100, "threads": 1,
    "scheduler": "sequential",
}


def _write_study(folder: Path, out: Path, **changes: Any) -> Path:
    """A study file beside its base run config (a relative path) with two arms and two final seeds."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.yaml").write_text(yaml.safe_dump(BASE))
    study = {"name": "zoo2", "base": "base.yaml", "output": str(out), "seeds": [1, 2], "jobs": 2,
             "arms": {"independent": {"strategy": "independent"}, "imitate": {"strategy": "imitate"}}, **changes}
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result[k] for k in AGGREGATE_KEYS if k in result}


def _final_test(record: dict[str, Any]) -> float:
    """The run's final test accuracy, the mean over its policies, read from its record directly."""
    last = {}
    for row in record["evals"]:
        if "test_acc" in row and row["step"] >= last.get(row["policy"], (-1, 0.0))[0]:
            last[row["policy"]] = (row["step"], row["test_acc"])
    assert set(last) == set(record["policies"])
    return statistics.fmean(acc for _, acc in last.values())


def test_a_two_arm_two_seed_study_on_the_zoo_runs_through_the_command_and_reaggregates(tmp_path, capsys):
    out = tmp_path / "out"
    study_file = _write_study(tmp_path / "def", out, target=50)
    assert main(["study", str(study_file)]) == 0
    err = capsys.readouterr().err
    assert "study zoo2 4/4 (100%)" in err  # the progress display (plain lines off a terminal)

    result = json.loads((out / "zoo2.json").read_text())
    assert result["final_seeds"] == [1, 2] and set(result["arms"]) == {"independent", "imitate"}
    assert all(result["arms"][a]["seeds"] == [1, 2] for a in result["arms"])
    assert result["arms"]["independent"]["role"] == "baseline" and result["arms"]["imitate"]["role"] == "sharing"
    records = {(r["arm"], r["seed"]): r for r in load_records(out / "zoo2_runs")}
    assert set(records) == {(a, s) for a in ("independent", "imitate") for s in (1, 2)}
    assert {r["strategy"] for r in records.values()} == {"independent", "imitate"}
    # the paired interval is the per-seed difference of the records' final test accuracy
    share = result["peers_share"]
    assert share["best_sharing_arm"] == "imitate" and share["strongest_baseline"] == "independent"
    expected = [100 * (_final_test(records["imitate", s]) - _final_test(records["independent", s])) for s in (1, 2)]
    assert share["values"] == pytest.approx(expected) and share["seeds"] == [1, 2]
    assert share["mean"] == pytest.approx(statistics.fmean(expected))
    half = 12.706 * statistics.stdev(expected) / 2 ** 0.5
    assert share["ci95"] == pytest.approx([share["mean"] - half, share["mean"] + half])
    assert result["arms"]["imitate"]["trained_tokens"]["values"] == [
        sum(s.get("train_tokens", 0) for s in records["imitate", seed]["steps"]) for seed in (1, 2)]
    assert "compute_match" in result and result["definition"]["arms"]["imitate"] == {"strategy": "imitate"}
    assert any("protocol asks for 5" in n for n in result["notes"])
    assert result["target"]["target"] == 50 and result["target"]["met"] is False  # the file's target, judged
    assert "2 final seeds (< 5)" in result["target"]["reasons"]
    assert (out / "zoo2_report" / "report.md").is_file() and (out / "zoo2_report" / "curves.png").is_file()
    metrics = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/metrics.jsonl")}
    assert len(metrics) == 4

    # --reuse: nothing trained again (the run directories untouched), the same figures
    assert main(["study", str(study_file), "--reuse", "--no-progress"]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/metrics.jsonl")} == metrics
    assert _figures(json.loads((out / "zoo2.json").read_text())) == _figures(result)
    # --aggregate: from the records alone, the same figures, a note saying so
    assert main(["study", str(study_file), "--aggregate"]) == 0
    again = json.loads((out / "zoo2.json").read_text())
    assert _figures(again) == _figures(result) and "re-aggregated" in again["notes"][-1]
    # the run directories gone (a fresh machine with the committed records): --reuse trains nothing
    shutil.rmtree(out / "runs")
    assert main(["study", str(study_file), "--reuse", "--no-progress"]) == 0
    assert not (out / "runs").exists() or not any((out / "runs").glob("*/metrics.jsonl"))
    assert _figures(json.loads((out / "zoo2.json").read_text())) == _figures(result)


class _SyntheticStudy(Study):
    """A study whose runs are records made up from their config: validation accuracy peaks at
    learning rate 3e-4, the sharing arm 5 points above its baseline on test."""

    def run(self, pairs):  # type: ignore[override]
        for arm, seed in pairs:
            self.arms.setdefault(arm.name, arm)
            cfg = self.config(arm, seed)
            lr = cfg["grpo"]["learning_rate"]
            val = 0.5 - abs(lr - 3e-4) * 100 + 0.01 * seed
            test = val + (0.05 if cfg["sharing"]["strategy"] == "imitate" else 0.0)
            write_record(self.runs_dir, {
                "arm": arm.name, "family": arm.family, "role": arm.role, "seed": seed, "overrides": arm.overrides,
                "strategy": cfg["sharing"]["strategy"], "policies": ["p"], "wall_s": 1.0, "git_rev": "r",
                "config": cfg, "evals": [{"policy": "p", "step": 2, "val_acc": val, "test_acc": test}],
                "steps": [{"policy": "p", "step": 1, "train_tokens": 10, "optimizer_steps": 1, "gen_tokens": 5}]})


def test_candidates_are_tuned_on_validation_and_grpo_from_passes_the_choice_on(tmp_path):
    data = {"base": dict(BASE), "seeds": [1, 2, 3], "tune_seeds": [0],
            "arms": {"imitate": {"strategy": "imitate", "role": "sharing", "grpo_from": "independent"},
                     "independent": {"strategy": "independent", "role": "baseline", "candidates": {
                         "lr1e-4": {"grpo": {"learning_rate": 1e-4}}, "lr3e-4": {"grpo": {"learning_rate": 3e-4}},
                         "lr1e-3": {"grpo": {"learning_rate": 1e-3}}}}}}
    spec = parse_study(data, tmp_path, "tuned")
    assert [[a.name for a in r] for r in spec.order()] == [["independent"], ["imitate"]]
    study = _SyntheticStudy(spec.name, lambda seed: dict(spec.base), tmp_path / "runs", results=tmp_path,
                            final_seeds=spec.seeds)
    result = run_study(spec, study)
    assert result["tuning"]["independent"]["chosen"] == "independent.lr3e-4"
    assert set(result["tuning"]["independent"]["candidates"]) == {"independent.lr1e-4", "independent.lr3e-4",
                                                                   "independent.lr1e-3"}
    assert result["arms"]["imitate"]["overrides"]["grpo"] == {"learning_rate": 3e-4}
    assert result["arms"]["independent"]["overrides"]["grpo"] == {"learning_rate": 3e-4}
    assert result["final_seeds"] == [1, 2, 3] and set(result["arms"]) == {"independent", "imitate"}
    assert result["peers_share"]["mean"] == pytest.approx(5.0)
    assert any("Candidates per arm" in n for n in result["notes"])  # 3 candidates for one side, 1 for the other
    assert isinstance(study.arms["imitate"], Arm)


@pytest.mark.parametrize(("changes", "field", "hint"), [
    ({"arms": {"independent": {"strategy": "independent"}, "imitate": {"stratgy": "imitate"}}},
     "arms.imitate.stratgy", "did you mean 'strategy'"),
    ({"arms": {"independent": {"strategy": "independent"}, "imitate": {"strategy": "imitat"}}},
     "arms.imitate.overrides", "sharing.strategy"),
    ({"tune_seeds": [1], "arms": {"independent": {"strategy": "independent", "candidates": {
        "a": {"grpo": {"learning_rate": 1e-4}}, "b": {"grpo": {"learning_rate": 3e-4}}}},
        "imitate": {"strategy": "imitate"}}}, "tune_seeds", "never a final seed"),
    ({"seeds": [1]}, "seeds", "at least 2"),
    ({"arms": {"a": {"strategy": "independent"}, "b": {"strategy": "self_imitate"}}}, "arms", "at least one"),
    ({"arms": {"independent": {"strategy": "independent"}, "imitate": {"strategy": "imitate",
                                                                      "grpo_from": "indep"}}},
     "arms.imitate.grpo_from", "not another arm"),
    ({"base": "missing.yaml"}, "base", "does not exist"),
    ({"val_size": 0}, "val_size", "positive integer"),
    ({"target": -1}, "target", "positive number"),
    ({"target": "five"}, "target", "positive number"),
])
def test_a_bad_study_file_exits_2_naming_the_field_and_writes_nothing(tmp_path, capsys, changes, field, hint):
    out = tmp_path / "out"
    study_file = _write_study(tmp_path / "def", out, **changes)
    assert main(["study", str(study_file)]) == 2
    err = capsys.readouterr().err
    assert f"'{field}'" in err and hint in err, err
    assert not out.exists()


def test_a_base_config_without_validation_is_refused(tmp_path, capsys):
    (tmp_path / "def").mkdir()
    base = {**BASE, "task": {"preset": "zoo", "test_size": 16}}
    path = tmp_path / "def" / "study.yaml"
    path.write_text(yaml.safe_dump({"base": base, "seeds": [1, 2], "output": str(tmp_path / "out"),
                                    "arms": {"i": {"strategy": "independent"}, "s": {"strategy": "imitate"}}}))
    assert main(["study", str(path)]) == 2
    assert "'val_size'" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_an_existing_output_needs_reuse_or_force(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["study", str(_write_study(tmp_path / "def", out)), "--no-progress"]) == 2
    assert "--reuse" in capsys.readouterr().err and (out / "keep.txt").is_file()
    assert main(["study", str(tmp_path / "def" / "study.yaml"), "--aggregate"]) == 2  # nothing to aggregate yet


def test_study_help_describes_the_file(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["study", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert all(word in text for word in ("STUDY.yaml", "--reuse", "--aggregate", "tune_seeds", "grpo_from", "NAME.json"))


def test_the_shipped_example_study_checks():
    spec = load_study(Path(__file__).resolve().parents[1] / "examples" / "studies" / "zoo_imitate.yaml")
    assert [(a.name, a.role) for a in spec.arms] == [("independent", "baseline"), ("self_imitate", "baseline"),
                                                     ("imitate", "sharing")]
    assert planned_runs(spec) == 2 * 3 + 3 * 5 and spec.base["task"]["val_size"] == 1000


def _same(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-9 relative (JSON written and read again)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a))
    return a == b


@pytest.mark.parametrize("name", ["mutual_protocol1", "mutual_taskmix_protocol1", "mutual_real_small_protocol1",
                                  "mutual_real_small_stage2", "mutual", "mutual_taskmix", "mutual_real_small"])
def test_the_committed_benchmark_studies_reaggregate_to_their_figures(name):
    """Every figure of a committed benchmark study comes back from its committed records alone
    through the library (its arms and declared final seeds)."""
    from mutualrl.study.aggregate import aggregate, committed_arms, committed_final_seeds, committed_target

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    if not (results / f"{name}.json").is_file():
        pytest.skip(f"{name}.json is not committed")
    committed = json.loads((results / f"{name}.json").read_text())
    again = aggregate(results, name, committed_arms(results, name), committed_final_seeds(results, name),
                      committed_target(results, name))
    assert _same(_figures(again), _figures(committed))
