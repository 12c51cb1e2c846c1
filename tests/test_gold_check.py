"""Data mistakes caught before training: gold answers in a known format the extractor ignores, and
gold answers the completions' extraction can never yield (mutualrl.tasks.gold_check)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from mutualrl.cli import main
from mutualrl.config.resolve import resolve
from mutualrl.errors import ConfigError
from mutualrl.tasks.base import extract_answer
from mutualrl.tasks.gold_check import ANSWER_IS_EXTRACTOR, GoldAnswerWarning

datasets = pytest.importorskip("datasets", reason="needs: pip install datasets (mutualrl[data])")

PAIRS = [(a, b) for a in range(11, 50, 2) for b in range(2, 7)]  # 100 rows


def _rows(answer) -> list[dict]:
    return [{"question": f"What is {a} + {b}?", "answer": answer(a + b)} for a, b in PAIRS]


def gsm8k(n: int) -> str:
    return f"Adding gives {n}.\n#### {n}"


def _write(tmp_path: Path, rows: list[dict], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(entry: dict, **task) -> dict:
    # zoo references resolve without building anything: only the data is read here
    return {"policies": [{"name": "a", "model": "zoo:gpt2-add"}],
            "task": {"datasets": [entry], "test_size": 8, "train_size": 40, **task}}


def _read(cfg: dict) -> None:
    resolve(cfg, read_data=True)


@pytest.mark.parametrize(("answer", "extractor"), [
    (gsm8k, "####"),
    (lambda n: f"We add the two numbers and get \\boxed{{{n}}}.", "boxed"),
    (lambda n: f"Adding the two gives it. The answer is {n}.", ANSWER_IS_EXTRACTOR),
])
def test_a_known_format_the_extractor_ignores_is_refused_naming_the_extractor(tmp_path, answer, extractor):
    path = _write(tmp_path, _rows(answer))
    with pytest.raises(ConfigError) as info:
        _read(_cfg({"path": str(path)}))
    assert info.value.field == "task.datasets[0].answer_extractor"
    assert f"answer_extractor: {extractor!r}" in str(info.value) and "100 of 100" in str(info.value)
    # the value named is the fix: with it the same data reads, and the gold is the number
    _read(_cfg({"path": str(path), "answer_extractor": extractor}))
    assert extract_answer(answer(57), extractor) == "57"


def test_the_math_verifier_reads_the_formats_itself_so_they_pass(tmp_path):
    """math-verify takes a text's last expression: '#### 57' read whole is 57, so nothing is refused."""
    pytest.importorskip("math_verify")
    _read(_cfg({"path": str(_write(tmp_path, _rows(gsm8k))), "verifier": "math"}))


def test_a_minority_of_rows_in_a_known_format_only_warns(tmp_path):
    rows = _rows(str)
    for r in rows[:10]:
        r["answer"] = gsm8k(int(r["answer"]))
    with pytest.warns(GoldAnswerWarning, match=r"task\.datasets\[0\]\.answer_extractor.*10 of 100.*'####'"):
        _read(_cfg({"path": str(_write(tmp_path, rows))}))


def test_clean_data_neither_refuses_nor_warns(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", GoldAnswerWarning)
        _read(_cfg({"path": str(_write(tmp_path, _rows(str)))}))


def test_multi_line_golds_under_first_line_can_never_be_matched(tmp_path):
    path = _write(tmp_path, _rows(lambda n: f"First add the tens.\nThen the ones: {n}"))
    with pytest.raises(ConfigError, match=r"100 of 100 .*can never be matched.*spans several lines.*'last_number'") \
            as info:
        _read(_cfg({"path": str(path)}))
    assert info.value.field == "task.datasets[0].answer_extractor"
    _read(_cfg({"path": str(path), "answer_extractor": "last_number"}))  # the fix named
    _read(_cfg({"path": str(path)}, answer_extraction="raw"))  # or completions read whole


def test_words_under_a_number_extraction_can_never_be_matched(tmp_path):
    rows = [{"question": f"Is {i} even?", "answer": "yes" if i % 2 == 0 else "no"} for i in range(60)]
    path = _write(tmp_path, rows)
    with pytest.raises(ConfigError, match=r"60 of 60 .*'last_number' cannot yield them.*not a number.*'first_line'") \
            as info:
        _read(_cfg({"path": str(path)}, answer_extraction="last_number"))
    assert info.value.field == "task.answer_extraction"  # numbers from completions, words as golds
    _read(_cfg({"path": str(path)}, answer_extraction="first_line"))


def test_unreadable_golds_in_a_known_format_name_the_extractor(tmp_path):
    """'boxed' on GSM8K rows reads no gold at all: the refusal names the extractor GSM8K needs."""
    with pytest.raises(ConfigError) as info:
        _read(_cfg({"path": str(_write(tmp_path, _rows(gsm8k))), "answer_extractor": "boxed"}))
    assert info.value.field == "task.datasets[0].answer_extractor" and "answer_extractor: '####'" in str(info.value)


def test_the_cli_refuses_with_one_line_and_writes_nothing(tmp_path, capsys):
    cfg = _cfg({"path": str(_write(tmp_path, _rows(gsm8k)))})
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    rc = main(["train", str(f), "-o", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "'task.datasets[0].answer_extractor'" in err and "'####'" in err
    assert not (tmp_path / "out").exists()


def test_mutual_trainer_refuses_a_gsm8k_dataset_with_the_default_extractor_and_trains_with_the_fix(
        tiny_models, tmp_path):
    from mutualrl.run.trainer import MutualTrainer

    ds = datasets.Dataset.from_list(_rows(gsm8k))
    cfg = {"policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])}],
           "task": {"test_size": 8, "train_size": 40},
           "grpo": {"num_generations": 2, "max_completion_length": 3},
           "steps": 1, "prompts_per_step": 2, "eval_every": 1, "eval_size": 8, "threads": 1}
    with pytest.raises(ConfigError) as info:
        MutualTrainer(cfg, tmp_path / "bad", train_dataset=ds, progress=False).train()
    assert info.value.field == "task.datasets[0].answer_extractor" and "'####'" in str(info.value)
    assert not (tmp_path / "bad").exists()  # refused before anything was written

    fixed = dict(cfg, task=dict(cfg["task"], datasets=[{"answer_extractor": "####"}]))
    trainer = MutualTrainer(fixed, tmp_path / "good", train_dataset=ds, progress=False)
    summary = trainer.train()
    assert "a" in summary["policies"] and (tmp_path / "good" / "checkpoints").is_dir()
