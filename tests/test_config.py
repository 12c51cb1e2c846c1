"""Config loading: bad input raises ConfigError naming the field; the CLI exits 2 and writes nothing."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from mutualrl.cli import main
from mutualrl.config import GRPOOptions, RunConfig
from mutualrl.config.resolve import load_config
from mutualrl.errors import ConfigError


@pytest.fixture()
def good(tiny_config) -> dict:
    cfg = copy.deepcopy(tiny_config)
    cfg["task"]["train_size"] = 200
    return cfg


def _bad(cfg: dict, path: str, value) -> dict:
    """A copy of ``cfg`` with the dotted ``path`` (list indices as numbers) set to ``value``."""
    out = copy.deepcopy(cfg)
    keys = path.split(".")
    node = out
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node.setdefault(k, {})
    last = keys[-1]
    node[int(last) if last.isdigit() else last] = value
    return out


BAD_CASES = [
    # (dotted path to set, value, field named in the error, words expected in the message)
    ("stepz", 3, "stepz", ["unknown field", "did you mean 'steps'"]),
    ("grpo.num_generation", 4, "grpo.num_generation", ["did you mean 'num_generations'"]),
    ("sharing.stratgy", "sgt", "sharing.stratgy", ["did you mean 'strategy'"]),
    ("steps", "ten", "steps", ["expected an integer"]),
    ("steps", 2.5, "steps", ["expected an integer"]),
    ("grpo.learning_rate", "fast", "grpo.learning_rate", ["expected a number"]),
    ("grpo.loss_type", "drgrpo", "grpo.loss_type", ["did you mean 'dr_grpo'"]),
    ("policies", {"name": "a"}, "policies", ["expected a list"]),
    ("steps", -1, "steps", [">= 1", "-1"]),
    ("steps", 0, "steps", [">= 1"]),
    ("grpo.num_generations", 1, "grpo.num_generations", [">= 2"]),
    ("policies.1.grpo", {"num_generations": 1}, "policies[1].grpo.num_generations", [">= 2"]),
    ("policies.0.grpo", {"num_generationz": 4}, "policies[0].grpo.num_generationz", ["did you mean"]),
    ("grpo.epsilon", 1.5, "grpo.epsilon", ["(0, 1)"]),
    ("sharing.max_staleness", -1, "sharing.max_staleness", [">= 0"]),
    ("policies.0.model", "/nonexistent/model/dir", "policies[0].model", ["does not exist"]),
    ("policies.0.model", "zoo:gpt2-ad", "policies[0].model", ["unknown zoo policy", "did you mean"]),
    ("policies.1.name", "a", "policies[1].name", ["duplicate"]),
    ("sharing.strategy", "xgrpoo", "sharing.strategy", ["did you mean 'xgrpo'"]),
    ("sharing.strategy", "prp+xgrpo", "sharing.strategy", ["'prp'"]),
    ("task.reward_functions", ["no_such_module_xyz:reward"], "task.reward_functions[0]", ["cannot import"]),
    ("task.reward_functions", ["json:no_such_fn"], "task.reward_functions[0]", ["no callable"]),
    ("task.answer_extraction", "regex:(", "task.answer_extraction", ["regular expression"]),
    ("task.answer_extraction", "lastnumber", "task.answer_extraction", ["last_number"]),
    ("exchange", "redis://x", "exchange", ["sqlite"]),
    # each field is named exactly, with the bad value
    ("sharing.sgt.weight", -1.0, "sharing.sgt.weight", [">= 0", "-1.0"]),
    ("sharing.prp.weight", -0.5, "sharing.prp.weight", [">= 0", "-0.5"]),
    ("sharing.prp.ratio_clip", 0.0, "sharing.prp.ratio_clip", ["> 0", "0.0"]),
    ("sharing.imitate.max_rowz", 3, "sharing.imitate.max_rowz", ["did you mean 'max_rows'"]),
    ("sharing.imitat", {"max_rows": 3}, "sharing.imitat", ["did you mean 'imitate'"]),
    ("sharing.xgrpo", {"x": 1}, "sharing.xgrpo", ["no settings"]),
    ("task.train_size", 0, "task.train_size", [">= 1", "0"]),
    ("task.test_size", -3, "task.test_size", [">= 1", "-3"]),
    ("grpo.warmup_ratio", 1.5, "grpo.warmup_ratio", ["[0, 1)", "1.5"]),
    ("grpo.adam_beta2", 1.0, "grpo.adam_beta2", ["[0, 1)"]),
    ("grpo.dynamic_sampling", "resampled", "grpo.dynamic_sampling", ["did you mean 'resample'"]),
    ("task.reward", "partial", "task.reward", ["'score'", "'exact'"]),
    ("report_to", "wandbb", "report_to", ["tensorboard", "wandb", "trackio"]),
    ("policies.0.device", "gpu0", "policies[0].device", ["cuda:N", "gpu0"]),
    ("policies.0.generation", {"gpu_memory_utilization": 1.5}, "policies[0].generation.gpu_memory_utilization",
     ["(0, 1]", "1.5"]),
    ("policies.0.peft", {"r": 0}, "policies[0].peft.r", [">= 1"]),
]


@pytest.mark.parametrize("path, value, field, words", BAD_CASES, ids=[f"{c[0]}={c[1]!r}" for c in BAD_CASES])
def test_bad_field_raises_config_error_naming_it(good, path, value, field, words):
    with pytest.raises(ConfigError) as info:
        load_config(_bad(good, path, value))
    assert info.value.field == field
    msg = str(info.value)
    assert f"'{field}'" in msg
    for w in words:
        assert w in msg


def test_trl_names_are_accepted(good):
    cfg = {k: v for k, v in good.items() if k not in ("steps", "eval_every", "checkpoint_every")}
    cfg.update(max_steps=7, eval_steps=3, save_steps=2, report_to=["tensorboard"])
    cfg["grpo"] = dict(good["grpo"], loss_type="bnpo")
    c = load_config(cfg)
    assert (c.steps, c.eval_every, c.checkpoint_every, c.report_to) == (7, 3, 2, ["tensorboard"])
    assert load_config(dict(cfg, report_to="none")).report_to == []
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert load_config(dict(cfg, grpo=dict(cfg["grpo"], loss_type=lt))).grpo.loss_type == lt
    with pytest.raises(ConfigError) as info:
        load_config(dict(cfg, steps=5))
    assert info.value.field == "max_steps" and "not both" in str(info.value)


def test_devices_this_machine_lacks_are_config_errors(good):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for where, field in (("device", "device"), ("policies.0.device", "policies[0].device")):
        with pytest.raises(ConfigError) as info:
            load_config(_bad(good, where, "cuda:3"))
        assert info.value.field == field and "CUDA is not available" in str(info.value)


def test_unknown_reasoning_gym_dataset(good):
    cfg = dict(good, task={"datasets": [{"name": "basic_arithmetc"}], "test_size": 10, "train_size": 50})
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.field == "task.datasets[0].name"
    assert "basic_arithmetic" in str(info.value)  # the suggestion
    cfg["task"]["datasets"] = [{"name": "basic_arithmetic", "config": {"min_termz": 2}}]
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.field == "task.datasets[0].config"
    cfg["task"]["datasets"] = [{"name": "basic_arithmetic", "path": "x.jsonl"}]
    with pytest.raises(ConfigError, match="exactly one"):
        load_config(cfg)
    cfg["task"]["datasets"] = [{"path": "/nonexistent/data.jsonl"}]
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.field == "task.datasets[0].path"


def test_model_dir_without_config_json(good, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(_bad(good, "policies.0.model", str(tmp_path / "empty")))
    assert info.value.field == "policies[0].model" and "config.json" in str(info.value)


def test_sharing_needs_two_policies(good):
    one = dict(good, policies=good["policies"][:1], sharing={"strategy": "sgt"})
    with pytest.raises(ConfigError) as info:
        load_config(one)
    assert info.value.field == "sharing.strategy"
    one["sharing"] = {"strategy": "independent"}
    assert len(load_config(one).policies) == 1


def test_good_config_builds_dataclasses(good):
    good["grpo"]["epsilon_high"] = 0.28
    good["policies"][1]["grpo"] = {"temperature": 0.7}
    good["sharing"] = {"strategy": "xgrpo+sgt", "sgt": {"weight": 0.2}}
    cfg = load_config(good)
    assert isinstance(cfg, RunConfig)
    assert cfg.steps == 3 and cfg.grpo.num_generations == 4
    assert isinstance(cfg.grpo.epsilon_high, float) and cfg.grpo.epsilon_high == 0.28
    assert cfg.policy_grpo(0).temperature == 1.0
    b = cfg.policy_grpo(1)
    assert isinstance(b, GRPOOptions) and b.temperature == 0.7 and b.num_generations == 4
    assert cfg.sharing.strategy == "xgrpo+sgt" and cfg.sharing.steps == {"sgt": {"weight": 0.2}}
    # YAML file round trip
    assert load_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)


# ----------------------------------------------------------------------------- the CLI
CLI_CASES = [
    ("stepz", 3, "stepz"),
    ("steps", "ten", "steps"),
    ("grpo.num_generations", 1, "grpo.num_generations"),
    ("policies.0.model", "/nonexistent/model/dir", "policies[0].model"),
    ("task.reward_functions", ["no_such_module_xyz:reward"], "task.reward_functions[0]"),
    ("sharing.strategy", "sgtt", "sharing.strategy"),
    ("steps", -5, "steps"),
]


@pytest.mark.parametrize("path, value, field", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_train_bad_config_exits_2_and_creates_nothing(good, tmp_path, capsys, path, value, field):
    cfg_path = tmp_path / "bad.yaml"
    cfg_path.write_text(yaml.safe_dump(_bad(good, path, value)))
    out = tmp_path / "run"
    rc = main(["train", str(cfg_path), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert not out.exists()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("mutualrl: error:") and f"'{field}'" in err


def test_cli_other_bad_inputs_exit_2(good, tmp_path, capsys):
    cfg_path = tmp_path / "good.yaml"
    cfg_path.write_text(yaml.safe_dump(good))
    out = tmp_path / "run"
    for argv in (["train", str(tmp_path / "missing.yaml"), "-o", str(out)],
                 ["train", str(cfg_path), "-o", str(out), "--strategy", "xgrpoo"],
                 ["train", str(cfg_path), "-o", str(out), "--steps", "0"],
                 ["train", "--resume", str(tmp_path / "not_a_run")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("mutualrl: error:"), (argv, err)
        assert not out.exists()
    assert not (Path.cwd() / "runs" / "missing").exists()


def test_cli_bad_data_file_exits_2_and_creates_nothing(good, tmp_path, capsys):
    """A JSONL file that exists but has a broken line fails before the run directory is written."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "answer": \n')
    cfg = dict(good, task={"datasets": [{"path": str(data)}], "test_size": 1, "train_size": 5})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert main(["train", str(cfg_path), "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.jsonl:2" in err
    assert not out.exists()


def test_a_policy_overrides_its_sharing_step_settings(tiny_config):
    """``policies[i].sharing`` overrides the run's ``sharing.<step>`` fields for that policy only (a
    token budget per policy, say): each worker builds its batches with its own merged settings; a block
    for a step the strategy does not run, an unknown field or a bad value is refused naming the policy."""
    from mutualrl.config.resolve import resolve
    from mutualrl.run.worker import PolicyWorker

    cfg = dict(tiny_config, sharing={"strategy": "imitate", "imitate": {"replay_steps": 4, "own_extra_rows": 8,
                                                                        "match_tokens": 100}})
    cfg["policies"] = [cfg["policies"][0], dict(cfg["policies"][1], sharing={"imitate": {"match_tokens": 10}})]
    plan = resolve(cfg)
    assert plan.config.policy_sharing(0)["imitate"]["match_tokens"] == 100
    got = []
    for i in (0, 1):
        w = PolicyWorker(plan, i, None)
        got.append((w.settings["imitate"].match_tokens, w.settings["imitate"].own_extra_rows))
        w.close()
    assert got == [(100, 8), (10, 8)]
    for bad, where in (({"sgt": {"weight": 1.0}}, r"policies\[1\]\.sharing\.sgt"),
                       ({"imitate": {"nope": 1}}, r"policies\[1\]\.sharing\.imitate\.nope"),
                       ({"imitate": {"match_tokens": -1}}, r"policies\[1\]\.sharing\.imitate\.match_tokens")):
        cfg["policies"][1] = dict(cfg["policies"][1], sharing=bad)
        with pytest.raises(ConfigError, match=where):
            load_config(cfg)
