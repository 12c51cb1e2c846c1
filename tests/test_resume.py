"""A resumed run keeps its word: accepted overrides are written back (and recorded), the Python API
is checked like the CLI, and a ``steps`` change that would alter a schedule is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from _stop import _Stop, _StopAfterStep3

from mutualrl.cli import main
from mutualrl.config.resolve import resolve_run
from mutualrl.errors import ConfigError
from mutualrl.run.resume import resumes
from mutualrl.run.trainer import MutualTrainer


def _config(tiny_models, **grpo) -> dict:
    return {"policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                         {"name": "b", "model": str(tiny_models["tiny-llama"])}],
            "task": {"preset": "zoo", "test_size": 16},
            "grpo": {"num_generations": 2, "max_completion_length": 4, **grpo},
            "steps": 2, "prompts_per_step": 2, "eval_every": 100, "eval_size": 8, "checkpoint_every": 1}


def _train(cfg: dict, run: Path) -> None:
    f = run.parent / "cfg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(f), "-o", str(run), "--no-progress"]) == 0


def _trained_steps(run: Path) -> list[int]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return sorted({r["step"] for r in rows if r.get("event") != "eval" and "step" in r})


def test_a_steps_override_is_written_back_so_a_later_plain_resume_continues_to_it(tiny_models, tmp_path):
    cfg, run = _config(tiny_models), tmp_path / "run"
    _train(cfg, run)
    # resumed with more steps, and crashed again before reaching them
    with pytest.raises(_Stop):
        _StopAfterStep3(dict(cfg, steps=4), run, resume=True, progress=False).train()
    assert yaml.safe_load((run / "config.yaml").read_text())["steps"] == 4
    assert resolve_run(run, {}).config.steps == 4  # what eval, compare and a plain --resume read
    record = resumes(run)
    assert len(record) == 1 and record[0]["step"] == 2 and record[0]["changes"] == {"steps": {"old": 2, "new": 4}}
    kept = json.loads((run / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["wall_s"]
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # no --steps this time
    assert _trained_steps(run) == [0, 1, 2, 3]
    # the summary's wall time is every segment's up to the checkpoint it resumed from, not the last one's
    assert json.loads((run / "summary.json").read_text())["wall_s"] > kept > 0
    assert len(resumes(run)) == 1  # a resume that changes nothing records nothing


def test_the_python_api_refuses_what_the_cli_refuses(tiny_models, tmp_path):
    cfg, run = _config(tiny_models), tmp_path / "run"
    _train(cfg, run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    changed = dict(cfg, grpo={**cfg["grpo"], "learning_rate": 1e-3})
    with pytest.raises(ConfigError, match=r"'grpo\.learning_rate'.*resum"):
        MutualTrainer(changed, run, resume=True, progress=False)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before  # nothing written
    MutualTrainer(dict(cfg, steps=3), run, resume=True, progress=False).train()  # a resumable change is taken
    assert _trained_steps(run) == [0, 1, 2]


@pytest.mark.parametrize("grpo, why", [({"lr_scheduler_type": "cosine"}, "cosine"),
                                       ({"warmup_ratio": 0.5}, "warmup_ratio")])
def test_a_steps_change_is_refused_where_the_schedule_depends_on_the_total(tiny_models, tmp_path, capsys, grpo, why):
    cfg, run = _config(tiny_models, **grpo), tmp_path / "run"
    _train(cfg, run)
    assert main(["train", "--resume", str(run), "--no-progress", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "'steps'" in err and why in err and "new run" in err
    assert yaml.safe_load((run / "config.yaml").read_text())["steps"] == 2 and resumes(run) == []
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "step_timeout_s=120"]) == 0  # others pass


def test_a_resume_to_fewer_steps_than_trained_is_refused_before_anything_is_written(tiny_models, tmp_path):
    cfg, run = _config(tiny_models), tmp_path / "run"
    _train(cfg, run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"'steps'.*fewer than the 2 steps"):
        MutualTrainer(dict(cfg, steps=1), run, resume=True, progress=False)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
