"""Any model on a run's task: ``mutualrl eval --model DIR_OR_HUB_ID --config CFG`` measures what the run
measures (same problems, prompts, extraction, verifier), so an exported policy scores the run's own
final ``test_acc`` and its base model the run's initial one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mutualrl.cli import main
from mutualrl.errors import UserError
from mutualrl.export.evaluate_model import evaluate_model


def _evals(run_dir: Path) -> dict[tuple[str, int], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["policy"], r["step"]): r for r in rows if r.get("event") == "eval"}


def _accuracies(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if k == "test_acc" or k.startswith("test_acc/")}


@pytest.mark.parametrize("policy", ["g", "l"])  # every weight trained; a LoRA adapter directory
def test_an_exported_policy_scores_the_runs_own_final_test_acc(trained_zoo_run, capsys, policy):
    exported = trained_zoo_run / "final" / policy  # written by the run itself (save_final_model)
    rc = main(["eval", "--model", str(exported), "--config", str(trained_zoo_run / "config.yaml"), "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    summary = json.loads((trained_zoo_run / "summary.json").read_text())["policies"][policy]
    assert got["test_acc"] == summary["test_acc_final"]
    assert _accuracies(got) == _accuracies(_evals(trained_zoo_run)[(policy, 2)])  # per task type too
    assert got["policy"] == policy and got["problems"] == 20  # the policy named by the export itself


def test_a_base_model_scores_the_runs_initial_test_acc_from_python(trained_zoo_run):
    got = evaluate_model("zoo:gpt2-add", trained_zoo_run, policy="g")  # a run directory as the config
    assert _accuracies(got) == _accuracies(_evals(trained_zoo_run)[("g", 0)])
    assert got["prompt_template"] == "{question} Answer: "


def test_the_table_output_and_a_prompt_template_of_ones_own(trained_zoo_run, capsys):
    rc = main(["eval", str(trained_zoo_run), "--model", str(trained_zoo_run / "final" / "g"), "--size", "4",
               "--prompt-template", "Q: {question} A: "])
    assert rc == 0
    out = capsys.readouterr().out
    assert "4 held-out problems" in out and "'Q: {question} A: '" in out
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["all", "add", "sub"]


def test_eval_of_a_run_directory_still_evaluates_its_last_checkpoint(trained_zoo_run, capsys):
    assert main(["eval", str(trained_zoo_run)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["checkpoint"].endswith("step_000002")
    evals = _evals(trained_zoo_run)
    assert {p: r["test_acc"] for p, r in got["results"].items()} == {p: evals[(p, 2)]["test_acc"] for p in "gl"}


@pytest.mark.parametrize(("args", "says"), [
    (["--model", "zoo:gpt2-add"], "--policy NAME"),  # two policies, and nothing says which
    (["--model", "zoo:gpt2-add", "--policy", "x"], "not a policy of the config"),
    (["--model", "./no/such/dir", "--policy", "g"], "no such directory"),
    (["--model", "zoo:gpt2-add", "--policy", "g", "--prompt-template", "no placeholder"], "{question}"),
    (["--model", "zoo:gpt2-ad", "--policy", "g"], "did you mean 'zoo:gpt2-add'"),
])
def test_bad_input_exits_2_with_one_line(trained_zoo_run, capsys, args, says):
    assert main(["eval", *args, "--config", str(trained_zoo_run / "config.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and says in err, err


def test_a_directory_that_is_no_model_and_a_missing_task_are_refused(trained_zoo_run, tmp_path, capsys):
    with pytest.raises(UserError, match="not a Hugging Face model directory"):
        evaluate_model(str(tmp_path), trained_zoo_run, policy="g")
    assert main(["eval", "--model", "zoo:gpt2-add"]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["eval"]) == 2
