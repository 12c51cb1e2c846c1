"""Zoo builds that stall stop early (or start over), and a progress display that tells the truth.

The builds here are tiny models whose validation figures are scripted (``accuracy`` replaced where
the warm start looks it up), so a phase can be made to plateau, stall or run long on purpose.
"""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from _zoo_task_file import task_file

from mutualrl import zoo
from mutualrl.errors import UserError
from mutualrl.run.progress import Progress
from mutualrl.zoo.stall import StallWatch, init_seed, landing_edges


def _tiny(**over) -> zoo.ZooSpec:
    """A tiny gpt2-add with a generalist phase (target 30 %), add band 35-100 %, sub 0-5 %, checks
    every 10 steps in both phases."""
    base = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_kv_head": 0, "n_inner": 64, "batch": 16,
            "max_positions": 64, "sft_eval_every": 10, "sft_max_steps": 4000, "generalist_max_steps": 4000,
            "generalist_target": 0.3, "sft_mixture": {"add": 1.0}, "bands": {"add": (0.35, 1.0), "sub": (0.0, 0.05)}}
    return dataclasses.replace(zoo.ZOO["gpt2-add"], **{**base, **over})


def _script(monkeypatch, per_attempt):
    """Validation figures by attempt: ``per_attempt[i](n)`` is the n-th check (from 0) of the i-th
    model built (a restart builds a new one). Returns the list of (attempt, check) calls made."""
    import mutualrl.zoo.sft as sft_module

    models: list[int] = []
    calls: list[tuple[int, int]] = []

    def fake(model, *a, **k):
        if id(model) not in models:
            models.append(id(model))
        attempt = models.index(id(model))
        n = sum(1 for a_, _ in calls if a_ == attempt)
        calls.append((attempt, n))
        return dict(per_attempt[attempt](n))

    monkeypatch.setattr(sft_module, "accuracy", fake)
    return calls


READY = {"add": 0.35, "sub": 0.31}
"""A generalist that has reached its 30 % target on both skills."""
STUCK = {"add": 0.60, "sub": 0.07}
"""A specialisation whose left-out skill sits just above its 0-5 % band (landing needs <= 4.25 %)."""


def test_the_stall_rule():
    """Progress = the best distance to the goal falls by min_gain (or reaches 0); noise inside that
    is none. A nudge after `patience` checks without progress (and again after as many more), the
    stall after `checks`."""
    w = StallWatch("specialise", {"sub": (0.0, 0.05)}, checks=6, min_gain=0.01, patience=2)
    figures = [0.20, 0.15, 0.145, 0.151, 0.146, 0.149, 0.147, 0.144]
    seen = [w.observe({"sub": v}, 10 * (i + 1)) for i, v in enumerate(figures)]
    assert [due for due, _ in seen] == [[], [], [], ["sub"], [], ["sub"], [], ["sub"]]
    stalls = [s for _, s in seen if s is not None]
    assert [s.checks for s in stalls] == [6]  # the 8th check (0.144) is no progress: 0.15 - 0.144 < 0.01
    s = stalls[0]
    assert (s.skill, s.value, s.goal, s.steps, s.step) == ("sub", 0.144, (0.0, 0.05), 60, 80)
    assert "sub at 14.4% on validation came no 1 point closer to at most 5.0% in 6 checks (60 steps)" in \
        s.describe(0.01)
    # reaching the goal is progress, and a skill inside its goal is never due or stalled
    w = StallWatch("generalist", {"add": (0.3, 1.0)}, checks=2, min_gain=0.01, patience=1)
    assert [w.observe({"add": v}, i) for i, v in enumerate([0.1, 0.35, 0.4, 0.45])] == [([], None)] * 4
    # settings at 0: no nudges, no stall
    w = StallWatch("banded", {"add": (0.3, 0.5)}, checks=0, min_gain=0.01, patience=0)
    assert all(w.observe({"add": 0.1}, i) == ([], None) for i in range(100))
    assert landing_edges({"a": (0.3, 0.5), "b": (0.0, 0.05)}, 0.15)["a"] == pytest.approx((0.33, 0.47))


def test_restart_seeds_are_derived_and_the_first_is_the_build_seed():
    assert init_seed(7, 0) == 7
    seeds = {init_seed(s, a) for s in range(5) for a in range(1, 4)}
    assert len(seeds) == 15 and all(s >= 2**16 for s in seeds) and init_seed(3, 1) == init_seed(3, 1)


def test_stall_settings_enter_the_cache_key_only_when_set():
    spec = zoo.ZOO["gpt2-add"]
    assert "stall_checks" in spec.to_dict()
    assert spec.cache_key(0) != dataclasses.replace(spec, stall_checks=5).cache_key(0)
    assert spec.cache_key(0) == dataclasses.replace(spec, stall_checks=spec.stall_checks).cache_key(0)
    assert spec.cache_key(0) != spec.cache_key(0, version="7")
    with pytest.raises(UserError, match="stall_checks"):
        dataclasses.replace(spec, stall_restarts=-1).check(["add", "sub"])


def test_a_specialisation_whose_left_out_skill_stays_above_its_band_is_nudged(monkeypatch):
    """No progress for stall_patience checks: the learning rate up 1.5x (to the spec's at most), and a
    left-out skill that still has a share is fed half as much."""
    import torch

    from mutualrl.zoo.build import corpus
    from mutualrl.zoo.sft import NUDGE_LR_STEP, SPECIALISE_LR_SCALE, sft
    from mutualrl.zoo.tokenizers import train_tokenizer

    spec = _tiny(sft_max_steps=90, stall_patience=2, stall_checks=50, sft_mixture={"add": 0.8, "sub": 0.2})
    _script(monkeypatch, [lambda n: READY if n == 0 else STUCK])
    task = zoo.default_task(0, test_size=10, train_size=2000)
    tok = train_tokenizer(spec.tokenizer, corpus(task, limit=500), spec.vocab_size)
    torch.manual_seed(0)
    res = sft(zoo.build_model(spec, tok), tok, task, spec, 0)
    assert not res.landed and res.stall is None and res.phase_steps == {"generalist": 10, "specialise": 90}
    nudges = [s for s in res.steering if s.get("phase") == "specialise"]
    assert [s["step"] for s in nudges] == [40, 60, 80, 100]  # specialise checks 2, 4, 6, 8 (patience 2)
    scales = [SPECIALISE_LR_SCALE * NUDGE_LR_STEP, SPECIALISE_LR_SCALE * NUDGE_LR_STEP ** 2, 1.0, 1.0]
    assert [s["lr_scale"] for s in nudges] == pytest.approx(scales) and res.lr_scale == 1.0
    halved = (1 / 18) / (8 / 9 + 1 / 18)  # 0.8/0.2 -> 0.889/0.111 -> 0.941/0.059, then the 5 % floor
    assert [s["mixture"]["sub"] for s in nudges] == pytest.approx([1 / 9, halved, 0.05, 0.05])
    assert all(s["above"] == ["sub"] and s["below"] == [] for s in nudges)


def test_the_generalist_phase_runs_at_its_own_rate_and_the_specialisation_at_a_third_of_lr(monkeypatch):
    """generalist_lr sets the generalist phase's rate (0: lr); the specialisation runs at lr / 3
    either way (what the optimizer was given at each step, warm-up past)."""
    import torch

    from mutualrl.zoo import steps as steps_module
    from mutualrl.zoo.build import corpus
    from mutualrl.zoo.sft import sft
    from mutualrl.zoo.tokenizers import train_tokenizer

    seen: list[float] = []
    original = steps_module.Steps.step

    def step(self, mixture):
        loss = original(self, mixture)
        seen.append(self.opt.param_groups[0]["lr"])
        return loss

    monkeypatch.setattr(steps_module.Steps, "step", step)
    task = zoo.default_task(0, test_size=10, train_size=2000)
    for general, want in ((1e-3, 1e-3), (0.0, 6e-3)):
        spec = _tiny(lr=6e-3, generalist_lr=general, warmup_steps=1, sft_max_steps=40, stall_patience=0)
        _script(monkeypatch, [lambda n: READY if n == 0 else {"add": 0.6, "sub": 0.03}])
        tok = train_tokenizer(spec.tokenizer, corpus(task, limit=500), spec.vocab_size)
        torch.manual_seed(0)
        seen.clear()
        res = sft(zoo.build_model(spec, tok), tok, task, spec, 0)
        assert res.landed and res.phase_steps == {"generalist": 10, "specialise": 10}
        assert seen == pytest.approx([want] * 10 + [2e-3] * 10)
    assert zoo.ZOO["gpt2-add"].generalist_lr == 1e-3 and zoo.ZOO["llama-sub"].generalist_lr == 0.0
    spec = zoo.ZOO["llama-sub"]
    assert spec.cache_key(1) != dataclasses.replace(spec, generalist_lr=1e-3).cache_key(1)
    assert spec.cache_key(1) == dataclasses.replace(spec, generalist_lr=0.0).cache_key(1)
    with pytest.raises(UserError, match="generalist_lr"):
        dataclasses.replace(spec, generalist_lr=-1.0).check(["add", "sub"])


def test_the_shipped_gpt2_add_stands_for_seed_0_of_todays_recipe():
    """The shipped gpt2-add ran its generalist phase at lr (3e-3); today's default runs it at 1e-3.
    The shipped build still serves build seed 0 of the default spec (and of the spec it was built
    from); any other rate, seed or `--rebuild` is built locally."""
    from mutualrl.zoo.build import is_shipped, policy_dir
    from mutualrl.zoo.shipped import SHIPPED_ROOT, shipped_built_with

    default = zoo.ZOO["gpt2-add"]
    assert shipped_built_with("gpt2-add") == {"generalist_lr": 0.0, "generalist_catch_up": 1.0}
    assert shipped_built_with("llama-sub") == {"generalist_catch_up": 1.0}
    assert is_shipped("gpt2-add") and is_shipped("gpt2-add", 0, dataclasses.replace(default, generalist_lr=0.0))
    assert is_shipped("gpt2-add", 0, dataclasses.replace(default, generalist_lr=0.0, generalist_catch_up=1.0))
    assert not is_shipped("gpt2-add", 0, dataclasses.replace(default, generalist_lr=5e-4))
    assert not is_shipped("gpt2-add", 0, dataclasses.replace(default, generalist_catch_up=0.5))
    assert is_shipped("llama-sub") and not is_shipped("llama-sub", 0, dataclasses.replace(zoo.ZOO["llama-sub"],
                                                                                          generalist_catch_up=0.5))
    assert not is_shipped("gpt2-add", 1)
    assert policy_dir("gpt2-add").parent == SHIPPED_ROOT
    assert policy_dir("gpt2-add", shipped=False).parent.parent != SHIPPED_ROOT


def test_a_warm_start_that_cannot_land_stops_early_with_exit_2_and_the_levers(tmp_path, monkeypatch, capsys):
    """`mutualrl zoo build --task`: the left-out skill plateaus just above its band. The build nudges,
    stalls, starts over from another initialisation, stalls again and exits 2 within a few dozen
    steps of its cap of 4,000 per phase, naming the policy, the skill, its figure, its band and the
    levers; nothing is written to the cache."""
    from mutualrl.cli import main

    monkeypatch.setitem(zoo.ZOO, "gpt2-add", _tiny())
    calls = _script(monkeypatch, [lambda n: READY if n == 0 else STUCK] * 2)
    path = task_file(tmp_path, stall_patience=2)
    cache = tmp_path / "cache"
    rc = main(["zoo", "build", "--task", str(path), "--jobs", "1", "--cache-dir", str(cache), "--stall-checks", "6"])
    captured = capsys.readouterr()
    assert rc == 2
    err = captured.err.strip().splitlines()[-1]
    second = init_seed(0, 1)
    assert err.startswith("mutualrl: error: zoo policy 'gpt2-plus' stopped early: its specialise phase stalled at "
                          f"step 80 after 1 restart from another initialisation (init seeds 0, {second}): sub at "
                          "7.0% on validation came no 1 point closer to at most 4.2% in 6 checks (60 steps)")
    for part in ("band of sub: 0%-5%", "add 60.0% (band 35%-100%), sub 7.0% (band 0%-5%)", "--seed",
                 "--stall-checks, now 6 checks", "--restarts, now 1", "--lr, now 0.003", "a looser band for sub",
                 "nothing was written"):
        assert part in err, part
    # two attempts of 1 generalist check + 7 specialisation checks each: 160 steps, not 2 x 8,000
    assert calls == [(a, n) for a in (0, 1) for n in range(8)]
    assert "stopped: zoo policy 'gpt2-plus' stopped early" in captured.err  # said at once by the build
    assert not any(p.name == "gpt2-plus" or p.name.startswith(".tmp-") for p in cache.rglob("*"))


def test_a_stalled_generalist_restarts_from_another_initialisation_and_lands(tmp_path, monkeypatch):
    """The first initialisation never gets its skills to the generalist target; the second does and
    lands. The card records both attempts, the init seed of the weights and the steps of each."""
    spec = _tiny(stall_checks=5)
    calls = _script(monkeypatch, [lambda n: {"add": 0.10, "sub": 0.12},
                                  lambda n: READY if n == 0 else {"add": 0.60, "sub": 0.03}])
    dirs = zoo.build_zoo(["gpt2-add"], cache_dir=tmp_path, progress=False, specs={"gpt2-add": spec}, jobs=1)
    card = zoo.load_card(dirs["gpt2-add"])
    assert calls == [(0, n) for n in range(6)] + [(1, 0), (1, 1)]
    first, second = card["attempts"]
    assert (first["init_seed"], first["steps"], first["landed"]) == (0, 60, False)
    assert first["stall"]["phase"] == "generalist" and first["stall"]["skill"] == "add" and first["stall"]["checks"] == 5
    assert (second["init_seed"], second["steps"], second["landed"]) == (init_seed(0, 1), 20, True)
    assert card["init_seed"] == init_seed(0, 1) and card["sft_steps_done"] == 20
    assert card["sft_steps_all_attempts"] == 80 and card["sft_phase_steps"] == {"generalist": 10, "specialise": 10}


LINE = re.compile(r"^(zoo gpt2-add \w+(?: \(restart \d+, init seed \d+\))?) (\d+)/(\d+) \((\d+)%\)")


def test_the_progress_count_never_passes_its_total(tmp_path, monkeypatch):
    """The generalist phase runs well past sft_max_steps (the total the display used to show: 4293/4000,
    107 %, eta 0:00), then a stall restarts it. Every update keeps the count within the total of the
    phase being run, no line reads over 100 % or eta 0:00, and the ETA is an upper bound."""
    from mutualrl.zoo.build import build_with_progress, policy_dir

    spec = _tiny(sft_max_steps=30, generalist_max_steps=200, stall_checks=4)
    plateau = [{"add": 0.05, "sub": 0.05}] * 6
    rising = [{"add": 0.02 * (n + 1), "sub": 0.02 * (n + 1)} for n in range(9)] + [READY]
    _script(monkeypatch, [lambda n: plateau[n], lambda n: (rising + [{"add": 0.5, "sub": 0.08},
                                                                     {"add": 0.5, "sub": 0.04}])[n]])
    seen: list[tuple[str, int, int, bool]] = []
    update = Progress.update

    def spy(self, done, info=None):
        update(self, done, info)
        seen.append((self.title, self.done, self.total, self.open_ended))

    monkeypatch.setattr(Progress, "update", spy)
    stream = io.StringIO()
    target = policy_dir("gpt2-add", 0, tmp_path, spec)
    card = build_with_progress(spec, 0, zoo.default_task(0, test_size=10, train_size=2000), target, stream=stream,
                               every=1)
    assert card["sft_phase_steps"] == {"generalist": 100, "specialise": 20} and len(card["attempts"]) == 2
    assert all(done <= total and not open_ended for _, done, total, open_ended in seen)
    totals = {title: total for title, _, total, _ in seen}
    assert totals == {"zoo gpt2-add generalist": 200, f"zoo gpt2-add generalist (restart 1, init seed "
                      f"{init_seed(0, 1)})": 200, f"zoo gpt2-add specialise (restart 1, init seed {init_seed(0, 1)})": 30}
    assert max(done for title, done, _, _ in seen if "generalist (restart" in title) == 100 > spec.sft_max_steps
    lines = [ln for ln in stream.getvalue().splitlines() if LINE.match(ln)]
    assert len(lines) == len(seen) == 50 + 100 + 20
    for ln in lines:
        _, done, total, pct = LINE.match(ln).groups()
        assert int(done) <= int(total) and int(pct) <= 100, ln
        assert "eta 0:00" not in ln and "eta ≤0:00" not in ln, ln
        assert ("eta ≤" in ln) == (int(done) < int(total)), ln
    assert "phase 1/2" in lines[0] and "phase 2/2" in lines[-1] and "val add 50% sub 4%" in lines[-1]
    assert stream.getvalue().splitlines()[-1].startswith("zoo gpt2-add specialise (restart 1, init seed")
    assert "landed at step 120" in stream.getvalue().splitlines()[-1]


def test_progress_past_its_total_turns_open_ended_and_never_reads_eta_0():
    stream = io.StringIO()
    with Progress("work", 4, every=1, stream=stream) as bar:
        for done in range(1, 7):
            bar.update(done)
        bar.begin("next", 3)
        bar.update(1)
    lines = stream.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == ["work 1/4 (25%)", "work 2/4 (50%)", "work 3/4 (75%)",
                                                    "work 4/4 (100%)", "work 5 (past the planned 4)",
                                                    "work 6 (past the planned 4)", "next 1/3 (33%)"]
    assert all(" eta " in ln for ln in lines[:3]) and not any(" eta " in ln for ln in lines[3:6])
    assert "eta 0:00" not in stream.getvalue()  # work left shows at least 0:01 however fast it goes
