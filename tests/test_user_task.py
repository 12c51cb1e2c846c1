"""A user's own task, as TRL users bring it: a Hugging Face dataset (GSM8K format), answers checked
by math-verify, reward functions as objects, runs tracked in wandb (offline) and trackio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mutualrl.cli import main
from mutualrl.tasks.verify import ExactVerifier

datasets = pytest.importorskip("datasets", reason="needs: pip install datasets (mutualrl[data])")

QUESTIONS = [(a, b) for a in range(11, 60, 3) for b in range(2, 9)]


def _gsm8k_rows() -> list[dict]:
    """GSM8K's shape: a word problem, and an answer whose reasoning ends with '#### <number>'."""
    return [{"question": f"Tom has {a} apples and gets {b} more. How many apples does he have?",
             "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"} for a, b in QUESTIONS]


def length_bonus(prompts, completions, **columns):
    """A TRL-style reward function (importable by path: tests must see the same in both routes)."""
    return [0.1 if len(c) < 4 else 0.0 for c in completions]


@pytest.fixture()
def gsm8k_dir(tmp_path: Path) -> Path:
    d = tmp_path / "gsm8k"
    datasets.Dataset.from_list(_gsm8k_rows()).save_to_disk(str(d))
    return d


def _config(tiny_models: dict, **task) -> dict:
    return {"policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                         {"name": "b", "model": str(tiny_models["tiny-llama"])}],
            "task": {"test_size": 16, "train_size": 64, **task},
            "grpo": {"num_generations": 2, "max_completion_length": 4},
            "sharing": {"strategy": "sgt"},
            "steps": 3, "prompts_per_step": 4, "eval_every": 2, "eval_size": 16, "checkpoint_every": 100}


OPTIONS = {"alias": "train", "answer_extractor": "####", "verifier": "exact"}


def test_a_dataset_trains_the_same_through_the_config_and_through_mutual_trainer(tiny_models, gsm8k_dir, tmp_path):
    from mutualrl.run.trainer import MutualTrainer

    path_route = _config(tiny_models, datasets=[{"dataset": str(gsm8k_dir), **OPTIONS}],
                         reward_functions=[f"{__name__}:length_bonus"])
    by_path = MutualTrainer(path_route, tmp_path / "by_path", progress=False)
    by_path.train()
    ds = datasets.load_from_disk(str(gsm8k_dir))
    by_object = MutualTrainer(_config(tiny_models, datasets=[OPTIONS]), tmp_path / "by_object",
                              train_dataset=ds, reward_funcs=[length_bonus], progress=False)
    by_object.train()
    keep = ("reward_mean", "train_acc", "test_acc", "loss", "gen_tokens", "sgt_rescue")

    def view(history):
        return [{k: r[k] for k in keep if k in r} | {"step": r["step"], "policy": r["policy"]} for r in history]

    assert view(by_path.history) == view(by_object.history)
    assert len(by_path.history) == 2 * 3 + 2 * 3  # 3 steps and 3 evaluations (0, 2, the end) of 2 policies
    # the gold answer is what follows '####' (the sum), and the reward function was called without a failure
    from mutualrl.tasks.build import build_task

    built = build_task(by_path.plan.config.task)
    sums = {f"Tom has {a} apples and gets {b} more. How many apples does he have?": str(a + b) for a, b in QUESTIONS}
    assert all(sums[p.question] == p.answer for p in built.problems("train") + built.problems("test"))
    assert all(r["reward_fn_raised"] == 0 for r in by_path.history if "reward_fn_raised" in r)


def test_a_lambda_reward_needs_the_sequential_scheduler(tiny_models, gsm8k_dir):
    from mutualrl.errors import ConfigError
    from mutualrl.run.trainer import MutualTrainer

    ds = datasets.load_from_disk(str(gsm8k_dir))
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\].*importable module"):
        MutualTrainer(dict(_config(tiny_models, datasets=[OPTIONS]), scheduler="local"), None,
                      train_dataset=ds, reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(completions)])


# ------------------------------------------------------------------ math verification
MATH_PAIRS = [
    # (gold, answer, equivalent)
    ("0.5", "\\frac{1}{2}", True), ("\\frac{1}{2}", "0.5", True), ("\\frac{1}{2}", "1/2", True),
    ("\\boxed{\\frac{1}{2}}", "\\frac12", True), ("\\dfrac{3}{4}", "0.75", True), ("3/4", "\\frac{3}{4}", True),
    ("72", "72.0", True), ("72", "$72$", True), ("72", "The answer is 72", True), ("1,000", "1000", True),
    ("-7", "-7.0", True), ("2^{10}", "1024", True), ("\\sqrt{2}", "\\sqrt 2", True),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt3}{2}}", True), ("2x+1", "1+2x", True), ("x=3", "3", True),
    ("\\{1,2\\}", "\\{2,1\\}", True), ("(1,2)", "(1, 2)", True), ("10\\%", "10", True), ("0.25", "\\frac14", True),
    ("\\pi", "\\pi", True), ("5", "5 dollars", True), ("\\text{(A)}", "A", True),
    ("3", "4", False), ("\\frac{1}{3}", "0.333", False), ("12", "121", False), ("\\pi", "3.14159", False),
    ("\\frac{1}{2}", "\\frac{1}{3}", False), ("2x+1", "2x-1", False), ("\\sqrt{2}", "2", False),
    ("72", "27", False), ("(1,2)", "(2,1)", False),
]


def test_math_verification_judges_every_pair_and_exact_match_misses_the_forms():
    from mutualrl.tasks.verify import MathVerifier

    assert len(MATH_PAIRS) >= 30
    math_v, exact = MathVerifier(), ExactVerifier()
    wrong = [(g, a) for g, a, eq in MATH_PAIRS if (math_v.score(math_v.read_gold(g), a) == 1.0) != eq]
    assert not wrong, wrong
    exact_wrong = [(g, a) for g, a, eq in MATH_PAIRS if (exact.score(exact.read_gold(g), a) == 1.0) != eq]
    # exact match takes '1/2' for something else than '0.5': it misses most equivalent forms
    assert len(exact_wrong) >= 15
    assert all(eq for g, a, eq in MATH_PAIRS if (g, a) in exact_wrong)  # its misses are all false negatives


def test_boxed_extraction_takes_nested_braces():
    from mutualrl.tasks.base import extract_answer

    assert extract_answer("so \\boxed{\\frac{1}{2}} it is", "boxed") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{a} then \\boxed{\\sqrt{\\frac{1}{2}}}", "boxed") == "\\sqrt{\\frac{1}{2}}"
    assert extract_answer("no box", "boxed") is None
    assert extract_answer("reasoning\n#### 1,072", "####") == "1072"


def test_conversational_rows_use_the_last_user_turn(tmp_path):
    from mutualrl.tasks.hf import DatasetSource

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}+1?"}],
             "solution": str(i + 1)} for i in range(20)]
    src = DatasetSource(datasets.Dataset.from_list(rows), "chat", test_fraction=0.25)
    probs = src.generate("train", 100, 0) + src.generate("test", 100, 0)
    assert len(probs) == 20 and all(p.question.startswith("What is") for p in probs)
    assert src.score(probs[0], probs[0].answer) == 1.0


# ------------------------------------------------------------------ tracking
def _tracked_run(tiny_models, tmp_path, report_to):
    from mutualrl.run.trainer import MutualTrainer

    cfg = dict(_config(tiny_models, preset="zoo"), report_to=report_to, run_name="tracked")
    MutualTrainer(cfg, tmp_path / "run", progress=False).train()


def test_wandb_offline_run_is_written(tiny_models, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs: pip install wandb (mutualrl[tracking])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _tracked_run(tiny_models, tmp_path, "wandb")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_trackio_run_is_written(tiny_models, tmp_path, monkeypatch):
    pytest.importorskip("trackio", reason="needs: pip install trackio (mutualrl[tracking])")
    import sqlite3

    import trackio.sqlite_storage as storage
    import trackio.utils as tu

    monkeypatch.setattr(tu, "TRACKIO_DIR", tmp_path / "trackio")
    monkeypatch.setattr(storage, "TRACKIO_DIR", tmp_path / "trackio", raising=False)
    _tracked_run(tiny_models, tmp_path, ["trackio", "tensorboard"])
    dbs = list((tmp_path / "trackio").glob("*.db"))
    assert dbs, list((tmp_path / "trackio").iterdir()) if (tmp_path / "trackio").exists() else "no trackio dir"
    with sqlite3.connect(dbs[0]) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "metrics" in names and conn.execute("SELECT count(*) FROM metrics").fetchone()[0] >= 3
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_report_to_errors_name_the_field(tiny_models):
    from mutualrl.config.resolve import load_config
    from mutualrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'report_to'.*comet") as info:
        load_config(dict(_config(tiny_models, preset="zoo"), report_to=["wandb", "comet"]))
    assert info.value.field == "report_to"


# ------------------------------------------------------------------ bad inputs
def _train_cli(tmp_path: Path, cfg: dict, capsys) -> tuple[int, str]:
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    capsys.readouterr()  # what the test itself printed so far (datasets' progress bars)
    rc = main(["train", str(f), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert not out.exists(), "nothing may be written for bad input"
    return rc, err


def _bad_case(tmp_path: Path, case: str, gsm8k_dir: Path) -> tuple[dict, str]:
    entry = {"dataset": str(gsm8k_dir), **OPTIONS}
    if case == "unknown column":
        return dict(entry, question_field="questoin"), "task.datasets[0].question_field"
    if case == "missing split":
        d = tmp_path / "splits"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(_gsm8k_rows())}).save_to_disk(str(d))
        return dict(entry, dataset=str(d), test_split="validation"), "task.datasets[0].test_split"
    if case == "not a dataset directory":
        d = tmp_path / "plain"
        d.mkdir()
        (d / "notes.txt").write_text("hello")
        return dict(entry, dataset=str(d)), "task.datasets[0].dataset"
    # gold answers the math verifier cannot read: the answer column holds prose without '####'
    d = tmp_path / "nogold"
    datasets.Dataset.from_list([{"question": f"q{i}", "answer": "see the reasoning above"} for i in range(20)]
                               ).save_to_disk(str(d))
    return dict(entry, dataset=str(d), verifier="math"), "task.datasets[0].answer_field"


@pytest.mark.parametrize("case", ["unknown column", "missing split", "not a dataset directory", "unreadable gold"])
def test_bad_data_exits_2_with_one_message_naming_the_field(tiny_models, gsm8k_dir, tmp_path, capsys, case):
    entry, field = _bad_case(tmp_path, case, gsm8k_dir)
    rc, err = _train_cli(tmp_path, _config(tiny_models, datasets=[entry]), capsys)
    assert rc == 2
    assert err.count("\n") == 0 and f"'{field}'" in err, err


def test_an_empty_split_is_refused_naming_it(tiny_models):
    """datasets cannot store an empty split with save_to_disk, so this comes through the Python API."""
    from mutualrl.errors import ConfigError
    from mutualrl.run.trainer import MutualTrainer
    from mutualrl.tasks.hf import DatasetSource
    from mutualrl.tasks.rows import SourceFieldError

    empty = datasets.Dataset.from_dict({"question": [], "answer": []})
    full = datasets.Dataset.from_list(_gsm8k_rows())
    with pytest.raises(SourceFieldError, match="'test' of the dataset is empty") as info:
        DatasetSource(datasets.DatasetDict({"train": full, "test": empty}), test_split="test")
    assert info.value.field == "test_split"
    with pytest.raises(ConfigError, match="'train' is empty") as info2:
        MutualTrainer(_config(tiny_models, datasets=[OPTIONS]), None, train_dataset=empty)
    assert info2.value.field == "train_dataset"


def test_gsm8k_example_plans_on_a_tiny_stand_in(tiny_models, gsm8k_dir, tmp_path, capsys):
    """examples/gsm8k_pair.yaml, its hub ids swapped for tiny local models and its dataset for a
    local copy of the same shape: `mutualrl plan` accepts it (engine hf here: no vLLM is needed)."""
    example = yaml.safe_load((Path(__file__).parents[1] / "examples" / "gsm8k_pair.yaml").read_text())
    assert [p["model"] for p in example["policies"]] == ["Qwen/Qwen2.5-0.5B-Instruct",
                                                          "meta-llama/Llama-3.2-1B-Instruct"]
    assert example["task"]["datasets"][0]["dataset"] == "openai/gsm8k"
    stand_in = json.loads(json.dumps(example))
    for p, tiny in zip(stand_in["policies"], ("tiny-gpt2", "tiny-llama"), strict=True):
        p["model"] = str(tiny_models[tiny])
        p["generation"]["engine"] = "hf"
        p["prompt_template"] = "{question} Answer: "
    stand_in["device"] = "auto"  # this machine has no GPU; the plan is the same shape
    stand_in["task"]["datasets"][0]["dataset"] = str(gsm8k_dir)
    stand_in["task"]["datasets"][0].pop("test_split", None)
    f = tmp_path / "stand_in.yaml"
    f.write_text(yaml.safe_dump(stand_in))
    assert main(["plan", str(f)]) == 0
    out = capsys.readouterr().out
    assert all(p["name"] in out for p in example["policies"])


def test_the_dataset_cache_survives_a_killed_writer(tmp_path, monkeypatch):
    """A copy a killed writer left (a partial directory, an old temporary sibling) is replaced by a
    complete one; a second call reuses it; no temporary directory is left behind."""
    import os

    from mutualrl.tasks import attach

    monkeypatch.setenv("MUTUALRL_CACHE", str(tmp_path / "cache"))
    ds = datasets.Dataset.from_list(_gsm8k_rows())
    key = f"train-{ds._fingerprint}"
    root = tmp_path / "cache" / "datasets"
    (root / key).mkdir(parents=True)
    (root / key / "data-00000-of-00001.arrow").write_bytes(b"half")  # no dataset_dict.json
    stale = root / f"{key}.x1.tmp"
    stale.mkdir()
    os.utime(stale, (0, 0))
    path, test = attach.saved_dataset(ds)
    assert (path, test) == (str(root / key), None)
    assert datasets.load_from_disk(path)["train"]["question"] == ds["question"]
    assert sorted(p.name for p in root.iterdir()) == [key]
    mtime = (root / key / "dataset_dict.json").stat().st_mtime_ns
    assert attach.saved_dataset(ds)[0] == path
    assert (root / key / "dataset_dict.json").stat().st_mtime_ns == mtime
