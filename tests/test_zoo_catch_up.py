"""The generalist phase's catch-up: once one skill has reached the generalist target, the batches
feed the skills still below it most of the time (``ZooSpec.generalist_catch_up``), and feed a skill
that falls back under the target evenly again. Validation figures are scripted and the optimizer
steps recorded instead of taken, so the mixture of every step can be read off."""

from __future__ import annotations

import dataclasses

import pytest
from _zoo_task_file import task_file

from mutualrl import zoo
from mutualrl.errors import UserError
from mutualrl.zoo.sft import catch_up


def _tiny(**over) -> zoo.ZooSpec:
    base = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_kv_head": 0, "n_inner": 64, "batch": 8,
            "max_positions": 64, "sft_eval_every": 10, "sft_max_steps": 200, "generalist_max_steps": 200,
            "generalist_target": 0.3, "sft_mixture": {"add": 1.0}, "bands": {"add": (0.35, 1.0), "sub": (0.0, 0.05)}}
    return dataclasses.replace(zoo.ZOO["gpt2-add"], **{**base, **over})


def _run(monkeypatch, script, **over):
    """The warm start of a tiny gpt2-add on scripted checks; returns (result, the mixture of every step)."""
    import torch

    import mutualrl.zoo.sft as sft_module
    from mutualrl.zoo.build import corpus
    from mutualrl.zoo.sft import sft
    from mutualrl.zoo.steps import Steps
    from mutualrl.zoo.tokenizers import train_tokenizer

    spec = _tiny(**over)
    it = iter(script)
    monkeypatch.setattr(sft_module, "accuracy", lambda *a, **k: dict(next(it)))
    fed: list[dict[str, float]] = []

    def step(self, mixture):
        fed.append(dict(mixture))
        self.done += 1
        return 0.0

    monkeypatch.setattr(Steps, "step", step)
    task = zoo.default_task(0, test_size=10, train_size=1500)
    tok = train_tokenizer(spec.tokenizer, corpus(task, limit=300), spec.vocab_size)
    torch.manual_seed(0)
    return sft(zoo.build_model(spec, tok), tok, task, spec, 0), fed


def test_catch_up_weights_the_reached_skills_down_and_renormalises():
    assert catch_up({"add": 1.0, "sub": 1.0}, ["add"], 0.25) == {"add": 0.2, "sub": 0.8}
    mix = {"a": 1.0, "b": 1.0, "c": 2.0}
    out = catch_up(mix, ["c"], 0.5)
    assert out == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}) and sum(out.values()) == pytest.approx(1.0)
    # after nudges have already starved a type to the floor, the catch-up keeps it there, not below
    from mutualrl.zoo.sft import MIN_SHARE, _steer

    nudged = _steer(_steer(_steer({"add": 0.5, "sub": 0.5}, ["add"], ["sub"]), ["add"], ["sub"]), ["add"], ["sub"])
    assert nudged["add"] == pytest.approx(MIN_SHARE)
    assert catch_up(nudged, ["add"], 0.25) == pytest.approx({"add": MIN_SHARE, "sub": 1 - MIN_SHARE})
    # none reached, all reached, or weight 1: the very same mixture (an even phase is the old recipe)
    for reached, weight in (([], 0.25), (["a", "b", "c"], 0.25), (["c"], 1.0)):
        assert catch_up(mix, reached, weight) is mix


def test_the_lagging_skill_gets_most_batches_until_it_catches_up(monkeypatch):
    """add reaches 30 % at the first check: the next ten steps draw add at 1/5 and sub at 4/5; add
    falls back under the target at the second check: even again; at the third it is back above;
    at the fourth both are there and the specialisation starts on add alone."""
    script = [{"add": 0.35, "sub": 0.10}, {"add": 0.25, "sub": 0.20}, {"add": 0.40, "sub": 0.25},
              {"add": 0.45, "sub": 0.31},                                  # generalist ends at step 40
              {"add": 0.60, "sub": 0.03}]                                  # the specialisation lands
    res, fed = _run(monkeypatch, script)
    even, lean = {"add": 1.0, "sub": 1.0}, {"add": 0.2, "sub": 0.8}
    assert fed[:40] == [even] * 10 + [lean] * 10 + [even] * 10 + [lean] * 10
    assert fed[40:] == [{"add": 1.0}] * 10 and res.landed and res.phase_steps == {"generalist": 40, "specialise": 10}
    assert [h.get("mixture") for h in res.history[:4]] == [lean, even, lean, even]  # recorded where it changed


def test_catch_up_1_is_an_even_generalist_phase(monkeypatch):
    script = [{"add": 0.35, "sub": 0.10}, {"add": 0.35, "sub": 0.20}, {"add": 0.35, "sub": 0.31},
              {"add": 0.60, "sub": 0.03}]
    res, fed = _run(monkeypatch, script, generalist_catch_up=1.0)
    assert fed[:30] == [{"add": 1.0, "sub": 1.0}] * 30 and res.landed
    assert not any("mixture" in h for h in res.history)


def test_catch_up_is_keyed_only_when_set_and_checked():
    spec = _tiny()
    assert zoo.ZOO["gpt2-add"].generalist_catch_up == zoo.ZOO["llama-sub"].generalist_catch_up == 0.25
    # a catch-up build is another build; at 1 the key is the one it had before the field existed
    # (the shipped builds keep theirs: test_zoo_stall.py)
    assert dataclasses.replace(spec, generalist_catch_up=1.0).cache_key(1) != spec.cache_key(1)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(UserError, match="generalist_catch_up"):
            dataclasses.replace(spec, generalist_catch_up=bad).check(["add", "sub"])


def test_the_catch_up_flag_and_task_file_field(tmp_path, capsys):
    """`zoo build --catch-up` takes a number in (0, 1]; a task file's entry sets generalist_catch_up per
    policy; bad values exit 2 naming the flag or the field."""
    from mutualrl.cli import main
    from mutualrl.zoo.cli import task_specs

    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit) as exc:
            main(["zoo", "build", "--catch-up", bad, "--cache-dir", str(tmp_path)])
        assert exc.value.code == 2 and "--catch-up" in capsys.readouterr().err
    path = task_file(tmp_path, generalist_catch_up=0.5)
    assert task_specs(path)[1]["gpt2-plus"].generalist_catch_up == 0.5
    for bad in ("half", 0, 1.5):
        with pytest.raises(UserError, match=r"zoo\[0\]\.generalist_catch_up"):
            task_specs(task_file(tmp_path, generalist_catch_up=bad))
