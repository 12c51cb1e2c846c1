"""One way in: dotted overrides, and on --resume every override applied or refused naming it."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from mutualrl.cli import main
from mutualrl.config.resolve import RunPlan, apply_overrides, parse_overrides, resolve, resolve_run
from mutualrl.errors import ConfigError


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_models) -> Path:
    """A two-step run with checkpoints (module-wide: the resume tests only read it or fail early)."""
    root = tmp_path_factory.mktemp("resolve")
    cfg = {"policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                        {"name": "b", "model": str(tiny_models["tiny-llama"])}],
           "task": {"preset": "zoo", "test_size": 16}, "grpo": {"num_generations": 2, "max_completion_length": 4},
           "sharing": {"strategy": "imitate"}, "steps": 2, "prompts_per_step": 2, "eval_every": 100,
           "eval_size": 8, "checkpoint_every": 1}
    f = root / "cfg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(f), "-o", str(root / "run"), "--no-progress"]) == 0
    return root / "run"


def test_dotted_overrides_reach_any_field(tiny_config):
    plan = resolve(tiny_config, parse_overrides(["policies.0.grpo.learning_rate=3e-5", "sharing.strategy=imitate",
                                                 "steps=7", "task.test_size=12"]))
    assert isinstance(plan, RunPlan)
    assert plan.workers[0].options.learning_rate == 3e-5 and plan.workers[1].options.learning_rate == 1e-4
    assert (plan.config.sharing.strategy, plan.config.steps, plan.config.task.test_size) == ("imitate", 7, 12)
    with pytest.raises(ConfigError, match="'policies.5'"):
        apply_overrides(tiny_config, {"policies.5.name": "x"})
    with pytest.raises(ConfigError, match="'grpo.num_generations'"):
        resolve(tiny_config, {"grpo.num_generations": 1})  # the override is checked like the file


def test_a_plan_crosses_a_process_boundary_as_json(tiny_config):
    from mutualrl.allocation.placement import exchange_url, place
    from mutualrl.allocation.planner import Resources, plan_for

    plan = resolve(tiny_config)
    cfg = plan.config
    placed = place(plan, plan_for(cfg, Resources(cpus=4)), "local", exchange_url("local", cfg, None, "/tmp/x"))
    assert placed.placed and all(w.device == "cpu" and w.threads == 2 and w.exchange.endswith("/tmp/x/exchange.db")
                                 for w in placed.workers)
    again = RunPlan.from_dict(json.loads(json.dumps(placed.to_dict())))
    assert again == placed


def test_a_resolved_config_is_immutable_all_the_way_down(tiny_config):
    from mutualrl.config.schema import FrozenError

    plan = resolve(tiny_config)
    cfg = plan.config
    for change in (lambda: setattr(cfg, "steps", 9), lambda: setattr(cfg.grpo, "learning_rate", 1.0),
                   lambda: setattr(plan.workers[0].options, "learning_rate", 1.0),
                   lambda: cfg.policies.append(cfg.policies[0]), lambda: setattr(cfg.policies[0], "name", "z"),
                   lambda: cfg.policies[0].grpo.update(beta=1.0), lambda: cfg.task.datasets.clear()):
        with pytest.raises(FrozenError):
            change()
    changed = dataclasses.replace(cfg, steps=9)  # a new config is made, not this one changed
    assert changed.steps == 9 and cfg.steps != 9
    assert copy.deepcopy(cfg.policies) == list(cfg.policies)


@pytest.mark.parametrize("flags, field", [
    (["--seed", "3"], "seed"),
    (["--strategy", "sgt"], "sharing.strategy"),
    (["--scheduler", "local"], "scheduler"),
    (["--set", "sharing.sgt.weight=0.5"], "sharing.sgt.weight"),
    (["--set", "grpo.learning_rate=1e-3"], "grpo.learning_rate"),
    (["--set", "policies.0.model=zoo:gpt2-add"], "policies.0.model"),
])
def test_resume_refuses_an_override_that_would_change_what_was_trained(finished_run, capsys, flags, field):
    before = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(finished_run), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert f"'{field}'" in err and "resum" in err and err.count("\n") == 1
    assert {p: p.stat().st_mtime_ns for p in finished_run.rglob("*") if p.is_file()} == before  # nothing written


def test_resume_applies_more_steps(finished_run, capsys):
    plan = resolve_run(finished_run, {"steps": 3, "step_timeout_s": 300.0})
    assert plan.config.steps == 3 and plan.config.step_timeout_s == 300.0
    assert main(["train", "--resume", str(finished_run), "--no-progress", "--steps", "3"]) == 0
    rows = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if r.get("event") != "eval") == 2  # steps 0, 1 trained before, 2 now
