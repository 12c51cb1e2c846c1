"""Tasks: disjoint splits, answer extraction, JSONL sources and guarded reward functions."""

from __future__ import annotations

import json
import math
import threading

import pytest

from mutualrl.tasks import FileSource, GymSource, Task, check_dataset, extract_answer, load_reward_function
from mutualrl.tasks.base import validate_extraction_mode
from mutualrl.zoo import default_task


@pytest.fixture(scope="module")
def zoo_task():
    return default_task(seed=0, test_size=200, train_size=3000)


def test_zoo_splits_are_disjoint_large_and_deterministic(zoo_task):
    test, train = zoo_task.problems("test"), zoo_task.problems("train")
    assert len(test) == 200 and len(train) > 2500
    assert {p.source for p in test} == {"add", "sub"}
    assert not {p.question for p in test} & {p.question for p in train}
    assert not {p.id for p in test} & {p.id for p in train}
    assert len({p.id for p in train}) == len(train)  # no duplicates
    again = default_task(seed=0, test_size=200, train_size=3000)
    assert [p.id for p in again.problems("test")] == [p.id for p in test]
    other = default_task(seed=1, test_size=200, train_size=300)
    assert [p.id for p in other.problems("test")] != [p.id for p in test]
    # every problem is looked up by id; unknown ids are not
    assert zoo_task.get(test[0].id) == test[0] and zoo_task.get("add/000000000000") is None


def test_sample_train_is_deterministic_and_from_train(zoo_task):
    a, b = zoo_task.sample_train(5, 16), zoo_task.sample_train(5, 16)
    assert [p.id for p in a] == [p.id for p in b]
    assert [p.id for p in a] != [p.id for p in zoo_task.sample_train(6, 16)]
    train_ids = {p.id for p in zoo_task.problems("train")}
    assert all(p.id in train_ids for p in a)
    # no prompt twice in one step (sharing is keyed by prompt id), both sources present
    for step in range(20):
        batch = zoo_task.sample_train(step, 64)
        assert len({p.id for p in batch}) == 64
        assert {p.source for p in batch} == {"add", "sub"}


def test_sample_train_repeats_only_when_the_pool_is_too_small(tmp_path):
    f = tmp_path / "three.jsonl"
    _write_jsonl(f, [{"question": f"q{i}", "answer": str(i)} for i in range(40)])
    task = Task([FileSource(f, test_fraction=0.1)], [1.0], test_size=2, train_size=3)
    assert len(task.problems("train")) == 3
    assert len({p.id for p in task.sample_train(0, 3)}) == 3
    assert len(task.sample_train(0, 7)) == 7


def test_zoo_verifier(zoo_task):
    p = zoo_task.problems("test")[0]
    assert zoo_task.verify(p, p.answer) == 1.0
    assert zoo_task.verify(p, f" {p.answer}\nthen more text") == 1.0  # first_line extraction
    assert zoo_task.verify(p, str(int(p.answer) + 1)) == 0.0
    assert zoo_task.verify(p, "") == 0.0
    assert zoo_task.verify(p, "\x00\ufffd garbage") == 0.0
    rewards, scores = zoo_task.rewards([p, p], ["q", "q"], [p.answer, "nope"])
    assert rewards == scores == [1.0, 0.0]


@pytest.mark.parametrize("text, mode, expected", [
    ("  \n 42 \nfoo", "first_line", "42"),
    ("", "first_line", ""),
    ("The answer is 1,234 or maybe -5.5 then", "last_number", "-5.5"),
    ("total: 1,234", "last_number", "1234"),
    ("no digits here", "last_number", None),
    (" 42\n\nQuestion: what is 7 + 1?", "first_number", "42"),
    ("no digits here", "first_number", None),
    (r"first \boxed{3} then \boxed{ 7 }", "boxed", "7"),
    ("no box", "boxed", None),
    ("ans=12; ans=34", r"regex:ans=(\d+)", "34"),
    ("x 99 y", r"regex:\d+", "99"),
    ("nothing", r"regex:\d+", None),
    ("  spaced out \n", "raw", "spaced out"),
])
def test_extract_answer_modes(text, mode, expected):
    assert extract_answer(text, mode) == expected


def test_extraction_mode_validation():
    for ok in ("first_line", "last_number", "boxed", "raw", r"regex:(\d+)"):
        assert validate_extraction_mode(ok) is None
    assert "regular expression" in validate_extraction_mode("regex:(")
    assert validate_extraction_mode("lastnum")
    with pytest.raises(ValueError):
        extract_answer("x", "lastnum")


def test_gym_source_checks_and_scoring():
    assert "did you mean" in check_dataset("basic_arithmetc", {})
    assert "unknown option" in check_dataset("basic_arithmetic", {"min_termz": 2})
    assert check_dataset("basic_arithmetic", {"min_terms": 2, "max_terms": 2}) is None
    with pytest.raises(ValueError):
        GymSource("no_such_dataset_xyz")
    src = GymSource("basic_arithmetic", "ba", {"min_terms": 2, "max_terms": 2, "max_digits": 1})
    probs = src.generate("test", 5, seed=3)
    assert len(probs) == 5 and all(p.id.startswith("ba/") for p in probs)
    assert src.score(probs[0], probs[0].answer) == 1.0
    assert src.score(probs[0], None) == 0.0


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_jsonl_source_split_and_verifier(tmp_path):
    rows = [{"q": f"What is {i} times 3?", "a": f"{3 * i:,}"} for i in range(400)]
    f = tmp_path / "mult.jsonl"
    _write_jsonl(f, rows)
    src = FileSource(f, question_field="q", answer_field="a", test_fraction=0.25)
    assert src.name == "mult"
    test = src.generate("test", 10_000, seed=1)
    train = src.generate("train", 10_000, seed=2)
    assert len(test) + len(train) == 400
    assert not {p.question for p in test} & {p.question for p in train}
    assert 60 < len(test) < 140  # ~25 %
    # the split does not depend on the per-split seed
    assert [p.id for p in src.generate("test", 10_000, seed=99)] == [p.id for p in test]
    p = next(p for p in train + test if p.question == "What is 399 times 3?")
    assert p.answer == "1,197"
    assert src.score(p, "1197") == 1.0 and src.score(p, "1,197.") == 1.0 and src.score(p, "1197.0") == 1.0
    assert src.score(p, "1198") == 0.0 and src.score(p, None) == 0.0
    task = Task([src], [1.0], test_size=20, train_size=50, seed=0)
    assert len(task.problems("test")) == 20 and len(task.problems("train")) == 50
    assert task.verify(p, "1197\nbecause") == 1.0


def test_sorted_file_gives_a_sample_not_its_first_or_last_rows(tmp_path):
    # a file sorted by operand: the first 200 test rows and the last 500 training rows (a zoo build's
    # validation slice) must each span the operands, not one end of them
    rows = [{"question": f"Calculate {i} * 3.", "answer": str(3 * i)} for i in range(100, 10_000)]
    f = tmp_path / "mul3.jsonl"
    _write_jsonl(f, rows)
    src = FileSource(f, test_fraction=0.2)

    def operands(problems):
        return [int(p.question.split()[1]) for p in problems]

    for xs in (operands(src.generate("test", 200, seed=0)), operands(src.generate("train", 10_000, seed=0))[-500:]):
        assert 4000 < sum(xs) / len(xs) < 6000
        assert sum(x < 1000 for x in xs) > 0.03 * len(xs) and sum(x >= 9000 for x in xs) > 0.03 * len(xs)
    # the order is a property of the rows, not of the file: reversing the file changes nothing
    g = tmp_path / "mul3_reversed.jsonl"
    _write_jsonl(g, rows[::-1])
    rev = FileSource(g, test_fraction=0.2)
    for split in ("train", "test"):
        assert [p.question for p in rev.generate(split, 10_000, 0)] == [p.question for p in src.generate(split, 10_000, 0)]


def test_jsonl_text_answers_fold_case_and_space(tmp_path):
    f = tmp_path / "words.jsonl"
    _write_jsonl(f, [{"question": "Capital of France?", "answer": "Paris"}])
    src = FileSource(f, test_fraction=0.0)
    (p,) = src.generate("train", 5, 0)
    assert src.score(p, "  paris ") == 1.0 and src.score(p, "Lyon") == 0.0


def test_jsonl_bad_line_and_missing_columns(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b", "answer": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        FileSource(f)
    f.write_text('{"question": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="row 2 lacks the columns"):
        FileSource(f)
    f.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no rows"):
        FileSource(f)
    with pytest.raises(ValueError, match="does not exist"):
        FileSource(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- reward functions
_RELEASE = threading.Event()


def reward_len(prompts, completions, **columns):
    assert set(columns) >= {"answer", "question", "source", "prompt_id"}
    return [0.1 * len(c) for c in completions]


def reward_raises(prompts, completions, **columns):
    raise RuntimeError("user code broke")


def reward_nan_second(prompts, completions, **columns):
    return [0.5, float("nan"), float("inf"), None][: len(completions)]


def reward_hangs(prompts, completions, **columns):
    _RELEASE.wait(30)
    return [1.0] * len(completions)


def reward_wrong_length(prompts, completions, **columns):
    return [1.0]


def _small_task(fns, timeout=10.0):
    task = default_task(seed=0, test_size=4, train_size=20)
    task.reward_functions = list(fns)
    task.reward_timeout_s = timeout
    return task


def test_reward_function_adds_to_verifier_score():
    task = _small_task([reward_len])
    p = task.problems("test")[0]
    rewards, scores = task.rewards([p, p], ["q", "q"], [p.answer, "xx"])
    assert scores == [1.0, 0.0]
    assert rewards == pytest.approx([1.0 + 0.1 * len(p.answer), 0.2])
    assert task.reward_stats.as_dict() == {"reward_fn_raised": 0, "reward_fn_non_finite": 0,
                                           "reward_fn_timed_out": 0}


def test_reward_function_that_raises_gives_zero_and_is_counted():
    task = _small_task([reward_raises, reward_wrong_length])
    p = task.problems("test")[0]
    rewards, _ = task.rewards([p, p, p], ["q"] * 3, [p.answer, "a", "b"])
    assert rewards == [1.0, 0.0, 0.0]  # verifier score kept, the failed extras add 0
    assert task.reward_stats.raised == 6  # 3 completions x 2 failing functions


def test_reward_function_non_finite_values_are_zeroed_and_counted():
    task = _small_task([reward_nan_second])
    p = task.problems("test")[0]
    rewards, _ = task.rewards([p] * 4, ["q"] * 4, ["a", "b", "c", "d"])
    assert rewards == [0.5, 0.0, 0.0, 0.0]
    assert all(math.isfinite(r) for r in rewards)
    assert task.reward_stats.non_finite == 3


def test_reward_function_that_hangs_times_out():
    task = _small_task([reward_hangs], timeout=0.3)
    p = task.problems("test")[0]
    try:
        rewards, _ = task.rewards([p, p], ["q", "q"], ["a", "b"])
        returned_while_hung = not _RELEASE.is_set()  # the reward function is still blocked: the timeout returned
    finally:
        _RELEASE.set()
    assert returned_while_hung
    assert rewards == [0.0, 0.0]
    assert task.reward_stats.timed_out == 2


def test_load_reward_function_paths():
    assert load_reward_function("json:dumps") is json.dumps
    assert load_reward_function("json.dumps") is json.dumps
    for bad in ("nodots", "no_such_module_xyz:f", "json:no_such_function", "json:__doc__"):
        with pytest.raises(ValueError):
            load_reward_function(bad)
