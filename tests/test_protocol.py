"""The study protocol's plumbing: a validation split disjoint from train and test, a prompt stream
that follows the run's seed on fixed splits, the test split read once, and warm starts that never
saw a test or validation question."""

from __future__ import annotations

import pytest

from mutualrl.config import TaskConfig
from mutualrl.tasks.build import build_task, eval_problems
from mutualrl.zoo.sft import warm_start_split
from mutualrl.zoo.specs import ZOO
from mutualrl.zoo.task import build_task_for_seed


def _questions(pools) -> set[str]:
    return {p.question for ps in pools.values() for p in ps}


def test_validation_split_is_disjoint_and_the_prompt_stream_follows_the_run_seed():
    t = TaskConfig(preset="zoo", test_size=100, train_size=2000, val_size=200)
    a, b = build_task(t, run_seed=0), build_task(t, run_seed=1)
    train, val, test = (_questions(a.split(s)) for s in ("train", "val", "test"))
    assert len(val) == 200 and not (train & val) and not (train & test) and not (val & test)
    # the splits depend on task.seed only; the prompts drawn per step on the run's seed
    assert all(_questions(a.split(s)) == _questions(b.split(s)) for s in ("train", "val", "test"))
    assert [p.id for p in a.sample_train(3, 16)] != [p.id for p in b.sample_train(3, 16)]
    assert {p.question for p in a.sample_train(3, 64)} <= train
    assert [p.id for p in build_task(TaskConfig(preset="zoo", test_size=100, train_size=2000, val_size=200,
                                                prompt_seed=1),
                                     run_seed=0).sample_train(3, 16)] == [p.id for p in b.sample_train(3, 16)]
    assert {p.question for p in eval_problems(a, 50, "val")} <= val and len(eval_problems(a, 50, "val")) == 50
    # without a validation split nothing changes: the run-seed-0 stream is the task seed's as before
    plain = build_task(TaskConfig(preset="zoo", test_size=100, train_size=2000))
    assert not plain.has_validation and plain.sample_train(2, 8) == build_task(
        TaskConfig(preset="zoo", test_size=100, train_size=2000), run_seed=0).sample_train(2, 8)


@pytest.mark.parametrize("build_seed", [0, 1, 3])
def test_no_warm_start_trains_on_a_test_or_validation_question(build_seed):
    """A zoo build of any seed warm-starts on training problems only: none is a test question or a
    validation question of a run on the zoo task (whose splits are seed 0's)."""
    run = build_task(TaskConfig(preset="zoo", test_size=1000, val_size=1000), run_seed=build_seed)
    held_out = _questions(run.split("test")) | _questions(run.split("val"))
    spec = ZOO["gpt2-add"]
    sft_train, sft_val = warm_start_split(build_task_for_seed(build_seed), spec.bands)
    assert not (_questions(sft_train) & held_out)
    # and what the build validates on is the run's validation split
    assert _questions(sft_val) == _questions(run.split("val"))


def test_a_fresh_held_out_split_is_disjoint_from_every_earlier_split_and_warm_start():
    """``heldout_seed`` draws a test split none of the seed-0 splits holds (nor any zoo warm start's
    data); training and validation stay the seed-0 ones; with ``val_like_test`` validation comes from
    the same fresh pool, disjoint from test."""
    base = {"preset": "zoo", "test_size": 1000, "val_size": 1000}  # the studies' sizes
    old = build_task_for_seed(1)  # the seed-0 splits every earlier run and warm start used
    new = build_task(TaskConfig(**base, heldout_seed=7))
    assert new.heldout_check([old]) == {"val/0": 1000, "test/0": 0}  # validation kept (seed 0's), test fresh
    kept = build_task(TaskConfig(**base))
    assert new.split("train") == kept.split("train") and new.split("val") == kept.split("val")
    sft_train, sft_val = warm_start_split(old, ZOO["gpt2-add"].bands)
    assert not (_questions(sft_train) | _questions(sft_val)) & _questions(new.split("test"))
    both = build_task(TaskConfig(**base, heldout_seed=7, val_like_test=True))
    assert both.heldout_check([old]) == {"val/0": 0, "test/0": 0}
    assert not _questions(both.split("val")) & _questions(both.split("test"))
    assert {k: len(v) for k, v in both.split("val").items()} == {"add": 500, "sub": 500}
    assert [p.id for p in both.problems("test")] != [p.id for p in new.problems("test")]  # cut at random


def test_a_fresh_split_the_problem_space_cannot_fill_is_refused_by_name():
    from mutualrl.config.resolve import load_config
    from mutualrl.errors import ConfigError

    with pytest.raises(ConfigError, match="task.heldout_seed"):
        load_config({"policies": [{"name": "a", "model": "zoo:gpt2-add"}],
                     "task": {"preset": "zoo", "heldout_seed": 0}}, check_paths=False)
    with pytest.raises(ConfigError, match="task.val_like_test"):
        load_config({"policies": [{"name": "a", "model": "zoo:gpt2-add"}],
                     "task": {"preset": "zoo", "val_like_test": True}}, check_paths=False)
    with pytest.raises(ValueError, match="outside the earlier splits"):  # 8,100 sums, nearly all drawn already
        build_task(TaskConfig(preset="zoo", test_size=4000, train_size=20000, heldout_seed=3))


def test_with_a_validation_split_the_test_split_is_read_once_at_the_end(tiny_config):
    from mutualrl.run.trainer import MutualTrainer

    cfg = dict(tiny_config, steps=4, eval_every=2, eval_size=20, checkpoint_every=100,
               task={"preset": "zoo", "test_size": 20, "val_size": 20, "train_size": 400})
    tr = MutualTrainer(cfg, None, progress=False)
    summary = tr.train()
    evals = [r for r in tr.history if r.get("event") == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, 2, 4]
    assert all("val_acc" in r for r in evals)
    assert [r["step"] for r in evals if "test_acc" in r] == [4, 4]  # once per policy, at the end
    # the accuracies a policy's summary reports (beside its compute: trained tokens, steps, FLOPs)
    assert {k for k in summary["policies"]["a"] if "_acc_" in k} == {
        "val_acc_initial", "val_acc_final", "val_acc_best", "test_acc_initial", "test_acc_final", "test_acc_best"}


def test_a_study_reuses_a_committed_record_trained_on_other_threads_only(tiny_config, tmp_path):
    """A study continued with other torch ``threads`` (a machine setting) keeps the committed record of
    a run; any change of what is trained retrains it."""
    import json

    from mutualrl.study import Arm, Study

    s = Study("t", lambda seed: dict(tiny_config, threads=1), tmp_path / "runs", results=tmp_path, reuse=True)
    arm = Arm("a", "independent", "baseline", {})
    (tmp_path / "t_runs").mkdir()
    (tmp_path / "t_runs" / "a-seed0.json").write_text(json.dumps({"config": s.config(arm, 0)}))
    assert s.finder.recorded("a", 0, dict(s.config(arm, 0), threads=2))
    assert not s.finder.recorded("a", 0, dict(s.config(arm, 0), steps=7))
    assert not s.finder.recorded("a", 1, s.config(arm, 1))


def test_an_arm_on_fewer_seeds_is_reported_apart_and_competes_on_the_common_seeds(tmp_path):
    """A study whose later seeds trained only the headline's arms keeps every arm: the headline over
    the longest seed list, the others over their own seeds, and the peers' share again over the
    seeds every arm holds, every baseline competing (here the stronger one only ran seeds 0-1)."""
    import json

    from mutualrl.study.aggregate import aggregate, committed_arms, rewrite

    runs = tmp_path / "s_runs"
    runs.mkdir()
    acc = {"share": [0.5, 0.6, 0.7], "weak": [0.4, 0.4, 0.4], "strong": [0.55, 0.65]}
    for arm, values in acc.items():
        role = "sharing" if arm == "share" else "baseline"
        for seed, a in enumerate(values):
            rec = {"arm": arm, "family": arm, "role": role, "seed": seed, "overrides": {}, "strategy": "x",
                   "policies": ["p"], "wall_s": 1.0, "git_rev": "r",
                   "evals": [{"policy": "p", "step": 4, "val_acc": a, "test_acc": a}],
                   "steps": [{"policy": "p", "step": 1, "train_tokens": 10, "optimizer_steps": 1, "gen_tokens": 5}]}
            (runs / f"{arm}-seed{seed}.json").write_text(json.dumps(rec))
    out = aggregate(tmp_path, "s", ["share", "weak", "strong"])
    assert out["final_seeds"] == [0, 1, 2] and set(out["arms"]) == {"share", "weak"}
    assert out["peers_share"]["strongest_baseline"] == "weak"
    assert abs(out["peers_share"]["mean"] - 20.0) < 1e-9
    assert out["arms_on_fewer_seeds"]["strong"]["seeds"] == [0, 1]
    common = out["on_common_seeds"]
    assert common["seeds"] == [0, 1] and common["peers_share"]["strongest_baseline"] == "strong"
    assert [round(v, 9) for v in common["peers_share"]["values"]] == [-5.0, -5.0]
    (tmp_path / "s.json").write_text(json.dumps(out))
    assert committed_arms(tmp_path, "s") == ["share", "weak", "strong"]
    # an arm absent from the committed result (a tuning candidate) stays out of a re-aggregation
    assert "weak" not in aggregate(tmp_path, "s", ["share", "strong"])["arms"]
    # --write: the figures replaced, what the study run recorded about itself kept, a note added
    (tmp_path / "s.json").write_text(json.dumps({**out, "peers_share": None, "efficiency": {"old": 1},
                                                 "tuning": {"t": 1}, "notes": ["n"]}))
    new = rewrite(tmp_path, "s", aggregate(tmp_path, "s", ["share", "weak"]))
    assert json.loads((tmp_path / "s.json").read_text()) == new
    assert new["tuning"] == {"t": 1} and new["notes"][0] == "n" and "re-aggregated" in new["notes"][1]
    assert abs(new["peers_share"]["mean"] - 20.0) < 1e-9 and "efficiency" not in new
    assert "arms_on_fewer_seeds" not in new and set(new["arms"]) == {"share", "weak"}


def test_declared_final_seeds_leave_a_tuning_run_out_and_a_later_stage_reuses_the_earlier_records(
        tiny_config, tmp_path, monkeypatch):
    """A study whose final seeds are fresh (3, 4) aggregates over them alone: the chosen baseline's run
    on the tuning seed 0 neither makes the headline's seed list nor moves the other arms aside. A later
    stage (``reuse_from``) takes the earlier stage's record of the same config into its own runs, and
    trains a changed config again."""
    import importlib
    import json
    from pathlib import Path

    from mutualrl.study import Arm, Study
    from mutualrl.study.aggregate import aggregate, committed_final_seeds

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench_study = importlib.import_module("study")  # benchmarks/study.py: re-aggregates benchmarks/results
    monkeypatch.setattr(bench_study, "RESULTS", tmp_path)
    runs = tmp_path / "s_runs"
    runs.mkdir()
    acc = {"share": {3: 0.6, 4: 0.7}, "base": {0: 0.9, 3: 0.5, 4: 0.5}}
    for arm, by_seed in acc.items():
        for seed, a in by_seed.items():
            rec = {"arm": arm, "family": arm, "role": "sharing" if arm == "share" else "baseline", "seed": seed,
                   "overrides": {}, "strategy": "x", "policies": ["p"], "wall_s": 1.0, "git_rev": "r",
                   "evals": [{"policy": "p", "step": 4, "val_acc": a, "test_acc": a}],
                   "steps": [{"policy": "p", "step": 1, "train_tokens": 10, "optimizer_steps": 1, "gen_tokens": 5}]}
            (runs / f"{arm}-seed{seed}.json").write_text(json.dumps(rec))
    longest = aggregate(tmp_path, "s", ["share", "base"])
    assert longest["final_seeds"] == [0, 3, 4] and set(longest["arms"]) == {"base"}  # the tuning run took over
    out = aggregate(tmp_path, "s", ["share", "base"], [3, 4])
    assert out["final_seeds"] == [3, 4] and set(out["arms"]) == {"share", "base"}
    assert out["arms"]["base"]["seeds"] == [3, 4] and abs(out["peers_share"]["mean"] - 15.0) < 1e-9
    (tmp_path / "s.json").write_text(json.dumps({**out, "declared_final_seeds": [3, 4]}))
    assert committed_final_seeds(tmp_path, "s") == [3, 4]
    assert bench_study._seeds("s", None) == [3, 4] and bench_study._seeds("s", "0,3") == [0, 3]

    first = Study("first", lambda seed: dict(tiny_config, threads=1), tmp_path / "r1", results=tmp_path, reuse=True)
    arm = Arm("a", "independent", "baseline", {})
    (tmp_path / "first_runs").mkdir()
    (tmp_path / "first_runs" / "a-seed0.json").write_text(json.dumps({"config": first.config(arm, 0)}))
    later = Study("later", lambda seed: dict(tiny_config, threads=2), tmp_path / "r2", results=tmp_path, reuse=True,
                  reuse_from=["first"])
    assert later.finder.recorded("a", 0, later.config(arm, 0))
    assert json.loads((tmp_path / "later_runs" / "a-seed0.json").read_text()) == {"config": first.config(arm, 0),
                                                                                  "reused_from": "first"}
    assert not later.finder.recorded("a", 0, dict(later.config(arm, 0), steps=7))
    assert not later.finder.recorded("a", 1, later.config(arm, 1))
    # only the earlier stage's tuning seeds are taken (its final runs' test split was read)
    (tmp_path / "first_runs" / "a-seed3.json").write_text(json.dumps({"config": first.config(arm, 3)}))
    fresh = Study("fresh", lambda seed: dict(tiny_config, threads=2), tmp_path / "r3", results=tmp_path, reuse=True,
                  reuse_from=["first"], reuse_from_seeds=[0])
    assert fresh.finder.recorded("a", 0, fresh.config(arm, 0))
    assert not fresh.finder.recorded("a", 3, fresh.config(arm, 3))
    # a record of the same config trained on other starting weights is trained again
    (tmp_path / "first_runs" / "a-seed0.json").write_text(json.dumps({"config": first.config(arm, 0),
                                                                       "weights": {"a": "elsewhere", "b": "x"}}))
    other = Study("other", lambda seed: dict(tiny_config, threads=2), tmp_path / "r4", results=tmp_path, reuse=True,
                  reuse_from=["first"])
    assert not other.finder.recorded("a", 0, other.config(arm, 0))


def test_runs_of_one_seed_from_different_builds_are_not_paired(tmp_path):
    """Two arms of one seed whose records name different starting weights (the same zoo cache path
    built on another CPU kind) are refused by the aggregation, naming the seed; equal weights pair."""
    import json

    from mutualrl.study import StudyError
    from mutualrl.study.aggregate import aggregate
    from mutualrl.study.provenance import weights_fingerprint

    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x00" * 8)
    built_here = weights_fingerprint(model)
    (model / "model.safetensors").write_bytes(b"\x01" * 8)
    assert weights_fingerprint(model) != built_here and weights_fingerprint(tmp_path / "x") == "none"
    runs = tmp_path / "s_runs"
    runs.mkdir()

    def record(arm: str, role: str, weights: str) -> None:
        rec = {"arm": arm, "family": arm, "role": role, "seed": 0, "overrides": {}, "strategy": "x", "policies": ["p"],
               "wall_s": 1.0, "git_rev": "r", "weights": {"p": weights},
               "evals": [{"policy": "p", "step": 4, "val_acc": 0.5, "test_acc": 0.5}],
               "steps": [{"policy": "p", "step": 1, "train_tokens": 10, "optimizer_steps": 1, "gen_tokens": 5}]}
        (runs / f"{arm}-seed0.json").write_text(json.dumps(rec))

    record("share", "sharing", built_here)
    record("base", "baseline", built_here)
    assert aggregate(tmp_path, "s", ["share", "base"])["final_seeds"] == [0]
    record("base", "baseline", weights_fingerprint(model))
    with pytest.raises(StudyError, match="seed 0: .*other weights"):
        aggregate(tmp_path, "s", ["share", "base"])


def test_a_sharing_arm_held_to_the_controls_compute_is_reported_against_it_apart(tmp_path):
    """A ``matched_sharing`` arm (the sharing arm held to the control's tokens per policy) is compared with
    the strongest baseline with its compute ratio, and never competes for the best sharing arm."""
    import json

    from mutualrl.study.aggregate import aggregate

    runs = tmp_path / "s_runs"
    runs.mkdir()
    arms = {"share": ("sharing", 0.6, 30), "base": ("baseline", 0.5, 10), "held": ("matched_sharing", 0.9, 10)}
    for arm, (role, acc, tokens) in arms.items():
        for seed in (0, 1):
            rec = {"arm": arm, "family": arm, "role": role, "seed": seed, "overrides": {}, "strategy": "x",
                   "policies": ["p"], "wall_s": 1.0, "git_rev": "r",
                   "evals": [{"policy": "p", "step": 4, "val_acc": acc, "test_acc": acc + 0.01 * seed}],
                   "steps": [{"policy": "p", "step": 1, "train_tokens": tokens, "optimizer_steps": 1, "gen_tokens": 5}]}
            (runs / f"{arm}-seed{seed}.json").write_text(json.dumps(rec))
    out = aggregate(tmp_path, "s", list(arms))
    assert out["peers_share"]["best_sharing_arm"] == "share" and abs(out["peers_share"]["mean"] - 10.0) < 1e-9
    held = out["matched_sharing"]["held"]
    assert held["vs_strongest_baseline"]["baseline"] == "base" and abs(held["vs_strongest_baseline"]["mean"] - 40) < 1e-9
    assert held["compute_match"]["trained_tokens"] == 1.0 and out["compute_match"]["within_10_percent"] is False


def test_the_compute_match_is_reported_per_seed_and_per_policy(tmp_path):
    """A sharing arm matched to its control on the two policies' sum can still train one policy far
    more than that policy's control: the compute match says so per policy and per seed."""
    import json

    from mutualrl.study.aggregate import aggregate

    runs = tmp_path / "s_runs"
    runs.mkdir()
    tokens = {"share": {"a": 30, "b": 10}, "base": {"a": 20, "b": 20}}  # equal sums, 1.5x and 0.5x per policy
    for arm, role, acc in (("share", "sharing", 0.6), ("base", "baseline", 0.5)):
        for seed in (0, 1):
            rec = {"arm": arm, "family": arm, "role": role, "seed": seed, "overrides": {}, "strategy": "x",
                   "policies": ["a", "b"], "wall_s": 1.0, "git_rev": "r",
                   "evals": [{"policy": p, "step": 4, "val_acc": acc, "test_acc": acc} for p in "ab"],
                   "steps": [{"policy": p, "step": 1, "train_tokens": tokens[arm][p] * (1 + seed),
                              "optimizer_steps": 1, "gen_tokens": 5} for p in "ab"]}
            (runs / f"{arm}-seed{seed}.json").write_text(json.dumps(rec))
    cm = aggregate(tmp_path, "s", ["share", "base"])["compute_match"]
    assert cm["trained_tokens"] == 1.0 and cm["within_10_percent"] is True
    assert cm["trained_tokens_per_seed"] == [1.0, 1.0]
    assert cm["trained_tokens_per_policy"] == {"a": {"mean": 1.5, "values": [1.5, 1.5]},
                                               "b": {"mean": 0.5, "values": [0.5, 0.5]}}
    assert cm["every_seed_and_policy_within_10_percent"] is False


def test_the_headline_inside_the_match_takes_the_strongest_baseline_matched_on_every_policy(tmp_path):
    """A baseline stronger on validation but trained on less (tokens, optimizer steps or FLOPs, on one
    policy is enough) is outside the match: the headline peers' share is taken against the strongest
    baseline within 10 % on every seed and policy, and its compute match says so; the strongest whatever
    its compute is reported beside it."""
    import json

    from mutualrl.study.aggregate import aggregate

    runs = tmp_path / "s_runs"
    runs.mkdir()
    spent = {"share": (100, 2, 1e9), "strong": (100, 2, 5e8), "matched": (95, 2, 1.05e9), "weak": (60, 1, 6e8)}
    accs = {"share": (0.70, 0.70), "strong": (0.66, 0.65), "matched": (0.62, 0.60), "weak": (0.5, 0.5)}
    for arm, (tok, opt, flops) in spent.items():
        for seed in (1, 2, 3):
            val, test = accs[arm]
            rec = {"arm": arm, "family": arm, "role": "sharing" if arm == "share" else "baseline", "seed": seed,
                   "overrides": {}, "strategy": "x", "policies": ["a", "b"], "wall_s": 1.0, "git_rev": "r",
                   "evals": [{"policy": p, "step": 4, "val_acc": val, "test_acc": test + 0.01 * seed} for p in "ab"],
                   "steps": [{"policy": p, "step": 1, "train_tokens": tok, "optimizer_steps": opt, "gen_tokens": 5,
                              "flops_sampling": flops / 2, "flops_scoring": 0.0,
                              "flops_update": flops / 2 * (1.5 if arm == "strong" and p == "b" else 1.0)}
                             for p in "ab"]}
            (runs / f"{arm}-seed{seed}.json").write_text(json.dumps(rec))
    out = aggregate(tmp_path, "s", list(spent))
    head = out["peers_share"]  # the headline: the strongest baseline inside the match
    assert head["inside_match"] is True and head["baselines_inside_match"] == ["matched"]
    assert head["strongest_baseline"] == "matched" and abs(head["mean"] - 10.0) < 1e-9
    assert out["compute_match"]["every_seed_and_policy_within_10_percent"] is True
    anyc = out["peers_share_any_compute"]  # beside it: the strongest on validation whatever its compute
    assert anyc["strongest_baseline"] == "strong"
    assert anyc["compute_match"]["every_seed_and_policy_within_10_percent"] is False  # FLOPs 2x / 1.6x
    assert anyc["compute_match"]["flops_per_policy"]["a"]["values"] == [2.0, 2.0, 2.0]
    assert out["arms"]["share"]["per_policy_compute"]["a"]["optimizer_steps"] == 2
    # no baseline inside: the headline falls back to the strongest whatever its compute, and says so
    out = aggregate(tmp_path, "s", ["share", "strong", "weak"])
    assert out["peers_share"]["strongest_baseline"] == "strong" and out["peers_share"]["inside_match"] is False
    assert out["compute_match"]["every_seed_and_policy_within_10_percent"] is False
    assert "target" not in out  # no target declared, no verdict


def test_the_study_json_judges_the_plans_target_and_a_reaggregation_keeps_it(tmp_path):
    """With the plan's target the JSON holds the verdict beside the headline (met only inside the match,
    on 5+ seeds, the interval above 0), and a re-aggregation judges against the committed target."""
    import json

    from mutualrl.study.aggregate import aggregate, committed_target, rewrite, table_lines

    runs = tmp_path / "s_runs"
    runs.mkdir()
    spent = {"share": (100, 2), "matched": (97, 2), "strong": (50, 1)}
    gain = {"share": 0.0, "matched": -0.06, "strong": -0.03}
    for arm, (tok, opt) in spent.items():
        for seed in range(1, 7):
            acc = 0.6 + gain[arm] + (0.01 * (seed % 3) if arm == "share" else 0.0)
            rec = {"arm": arm, "family": arm, "role": "sharing" if arm == "share" else "baseline", "seed": seed,
                   "overrides": {}, "strategy": "x", "policies": ["a", "b"], "wall_s": 1.0, "git_rev": "r",
                   "evals": [{"policy": p, "step": 4, "val_acc": acc, "test_acc": acc} for p in "ab"],
                   "steps": [{"policy": p, "step": 1, "train_tokens": tok, "optimizer_steps": opt, "gen_tokens": 5}
                             for p in "ab"]}
            (runs / f"{arm}-seed{seed}.json").write_text(json.dumps(rec))
    out = aggregate(tmp_path, "s", list(spent), list(range(1, 7)), target=5.0)
    assert out["peers_share"]["strongest_baseline"] == "matched" and out["peers_share"]["mean"] > 5
    assert out["target"]["met"] is True and out["target"]["reasons"] == []
    missed = aggregate(tmp_path, "s", list(spent), [1, 2, 3], target=5.0)["target"]
    assert missed["met"] is False and missed["reasons"] == ["3 final seeds (< 5)"]
    assert missed["power"]["seeds_at_target"] >= 2  # a miss says what power would need
    outside = aggregate(tmp_path, "s", ["share", "strong"], list(range(1, 7)), target=5.0)["target"]
    assert outside["met"] is False and "baseline not compute-matched per policy" in outside["reasons"]
    assert "mean +4.0 below the target" in outside["reasons"]
    pending = aggregate(tmp_path, "s", list(spent), list(range(1, 9)), target=5.0)["target"]
    assert pending["met"] is None and pending["reasons"][0].startswith("pending")  # seeds 7, 8 not run yet
    (runs / "strong-seed6.json").rename(tmp_path / "strong-seed6.json")  # a headline, but one arm still short
    short = aggregate(tmp_path, "s", list(spent), list(range(1, 7)), target=5.0)
    assert short["peers_share"]["strongest_baseline"] == "matched" and short["target"]["met"] is None
    assert "strong" in short["target"]["reasons"][0]
    assert "target ≥ +5: pending: strong" in "\n".join(table_lines(short))
    (tmp_path / "strong-seed6.json").rename(runs / "strong-seed6.json")
    tuning = aggregate(tmp_path, "s", list(spent), [11, 12, 13, 14, 15], target=5.0)  # no final record yet
    assert tuning["target"]["met"] is None and "missed" not in "\n".join(table_lines(tuning))
    assert "missed (3 final seeds (< 5)" in "\n".join(table_lines(aggregate(tmp_path, "s", list(spent), [1, 2, 3],
                                                                               target=5.0)))
    (tmp_path / "s.json").write_text(json.dumps({**out, "notes": []}))
    assert committed_target(tmp_path, "s") == 5.0
    again = rewrite(tmp_path, "s", aggregate(tmp_path, "s", ["share", "strong"], list(range(1, 7))))
    assert "target" not in again  # an aggregation without the target drops the old verdict, never keeps it stale


@pytest.mark.parametrize("types", [["add", "mul"], ["mul", "add"]])
def test_the_real_model_studys_zero_shot_problems_are_none_of_its_test_questions(types, monkeypatch):
    """The zero-shot study that picks the real-model study's task types reads validation problems;
    none is a test question of the study's task, whichever types it holds in whatever order (a type's
    test problems depend on its place in the task's list)."""
    import argparse
    from pathlib import Path

    from mutualrl.config.resolve import resolve_task
    from mutualrl.tasks.build import build_task

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mutual_real_small as study

    _, problems = study.zero_shot_problems(40)
    assert all(len(ps) == 40 for ps in problems.values()) and set(problems) == set(study.CANDIDATES)
    args = argparse.Namespace(quick=False, generations=4, steps=10, prompts=4, evals=2, jobs=1)
    choice = {"tasks": types, "extraction": "last_number",
              "formats": {"smollm2": {"prompt_template": "{question} Answer: "},
                          "gemma3": {"prompt_template": "{question} Answer: "}}}
    task = build_task(resolve_task(study.base_config(choice, args, 0)["task"], check_paths=False))
    for t in types:
        test = {p.question for p in task.split("test")[t]}
        assert len(test) == study.TEST_PER_TYPE and not test & {p.question for p in problems[t]}, t


def _real_small(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mutual_real_small

    return mutual_real_small


def _zero_shot_table(study, acc):
    """A zero-shot table: each model's formats with ``acc[model][format index][type]`` under both
    extractions (the other candidate types at 0)."""
    return {m: [{**fmt, "accuracy": {ex: {t: acc[m][i].get(t, 0.0) for t in study.CANDIDATES}
                                     for ex in study.EXTRACTIONS}}
                for i, fmt in enumerate(study.FORMATS[m][:2])] for m in ("smollm2", "gemma3")}


def test_the_real_pairs_formats_are_chosen_on_the_types_it_keeps(monkeypatch):
    """A type a constant answer solves is left out before anything is chosen: a format that is best
    only on that type is not chosen; a model that solves nothing zero-shot can still learn a type its peer
    solves (the pair is taken, by the type the peer solves best); a pair with a type neither solves is
    refused."""
    study = _real_small(monkeypatch)
    a, b, shortcut = list(study.CANDIDATES)[:3]
    acc = {"smollm2": [{a: 0.6, b: 0.2}, {a: 0.5, b: 0.1}],
           "gemma3": [{shortcut: 0.9}, {a: 0.1, b: 0.5}]}  # format 0 is best on the shortcut type alone
    got = study.choose(_zero_shot_table(study, acc), {shortcut: 0.5}, n=100)
    assert got["formats"]["gemma3"] == study.FORMATS["gemma3"][1] and set(got["tasks"]) == {a, b}
    assert got["excluded_shortcut"] == {shortcut: 0.5}
    c = list(study.CANDIDATES)[3]
    zero = {"smollm2": [{a: 0.3, b: 0.02, c: 0.03}, {}], "gemma3": [{}, {}]}  # the real pair: gemma3 solves nothing
    got = study.choose(_zero_shot_table(study, zero), {shortcut: 0.5}, n=100)
    assert set(got["tasks"]) == {a, c} and "ties by the pair" in got["rule"]  # c's 0.03 beats b's 0.02
    never = {"smollm2": [{a: 0.6}, {}], "gemma3": [{a: 0.3}, {}]}  # every pair holds a type neither solves
    with pytest.raises(SystemExit, match="neither model solves"):
        study.choose(_zero_shot_table(study, never), {shortcut: 0.5}, n=100)


def test_a_matched_control_of_a_policy_that_trained_nothing_adds_at_most_one_row(tiny_config, tmp_path):
    """match_tokens 0 means no limit: a zero budget becomes 1, never an unbounded control."""
    from mutualrl.study import Study

    s = Study("t", lambda seed: dict(tiny_config), tmp_path / "runs", results=tmp_path)
    names = [p["name"] for p in tiny_config["policies"]]
    pols = s.matched_overrides(0, "self_imitate", {n: 0 if i == 0 else 37 for i, n in enumerate(names)})["policies"]
    assert [p["sharing"]["self_imitate"]["match_tokens"] for p in pols] == [1] + [37] * (len(names) - 1)


def test_a_control_matched_step_by_step_takes_the_arms_tokens_in_step_order(tiny_config, tmp_path):
    """Study.policy_schedule reads a run's trained tokens per policy in step order (a record's steps
    may come in any order); matched_overrides puts them in ``match_schedule`` beside the mean budget."""
    import json

    from mutualrl.study import Arm, Study

    s = Study("t", lambda seed: dict(tiny_config), tmp_path / "runs", results=tmp_path)
    names = [p["name"] for p in tiny_config["policies"]]
    (tmp_path / "t_runs").mkdir()
    steps = [{"policy": n, "step": t, "train_tokens": (t + 1) * (i + 1) * 10 if t != 1 else 0}
             for t in (2, 0, 1) for i, n in enumerate(names)]
    (tmp_path / "t_runs" / "best-seed0.json").write_text(json.dumps(
        {"arm": "best", "seed": 0, "policies": names, "steps": steps}))
    sched = s.policy_schedule(Arm("best", "x", "sharing", {}), 0)
    assert sched == {n: [10 * (i + 1), 0, 30 * (i + 1)] for i, n in enumerate(names)}
    pols = s.matched_overrides(0, "self_imitate", {n: 5 for n in names}, schedule=sched)["policies"]
    assert [p["sharing"]["self_imitate"]["match_schedule"] for p in pols] == [sched[n] for n in names]


def test_a_grid_at_its_edge_after_the_last_extension_adds_no_rate_it_never_trains(monkeypatch):
    """tune_grid extends a rate list while the choice sits at an edge, MAX_EXTENSIONS times; after the
    last, the recorded rates are the ones trained and the notes say the edge remained."""
    _real_small(monkeypatch)  # benchmarks/ on the path
    import mutual

    from mutualrl.study import Arm

    study = _FakeTuning(lambda lr: lr)  # the higher the rate, the better: always the top
    chosen = mutual.tune_grid(study, "f", {"v": (lambda lr: Arm(f"v{lr:g}", "f", "baseline", {"lr": lr}), [1e-4])},
                              [0])
    rates = study.tuning["f"]["rates"]["v"]
    assert len(rates) == mutual.MAX_EXTENSIONS + 1 and {f"v{r:g}" for r in rates} == study.trained
    assert chosen.overrides["lr"] == max(rates) and "still at an edge" in study.notes[-1]


class _FakeTuning:
    """A study whose tune() scores each candidate by ``score(lr)`` and, like the harness, takes the
    first of the best in the candidates' order (rates ascending)."""

    def __init__(self, score) -> None:
        self.notes: list[str] = []
        self.tuning: dict = {}
        self.trained: set = set()
        self.score = score

    def tune(self, family, cands, seeds):
        self.trained |= {c.name for c in cands}
        scores = {c.name: {"mean": self.score(c.overrides["lr"])} for c in cands}
        chosen = max(cands, key=lambda c: scores[c.name]["mean"])
        self.tuning[family] = {"candidates": scores, "chosen": chosen.name}
        return chosen


def test_an_edge_choice_that_ties_a_rate_inside_the_grid_takes_the_inside_one_and_extends_nothing(monkeypatch):
    """Validation flat over the rates (few steps, a coarse split): the first of the best is the lowest
    rate, an edge, but the same score inside the grid means the optimum is not beyond it: the inside
    rate nearest the middle is chosen, no rate added; without a tie the edge is extended."""
    _real_small(monkeypatch)  # benchmarks/ on the path
    import mutual

    from mutualrl.study import Arm

    grid = {"v": (lambda lr: Arm(f"v{lr:g}", "f", "baseline", {"lr": lr}), [1e-5, 3e-5, 1e-4])}
    flat = _FakeTuning(lambda lr: 0.5)
    chosen = mutual.tune_grid(flat, "f", grid, [0])
    assert chosen.overrides["lr"] == 3e-5 and flat.tuning["f"]["chosen"] == "v3e-05"
    assert flat.trained == {"v1e-05", "v3e-05", "v0.0001"} and "ties v3e-05" in flat.notes[-1]
    low = _FakeTuning(lambda lr: -lr)  # the lowest rate best alone, every time: extended down
    assert mutual.tune_grid(low, "f", grid, [0]).overrides["lr"] < 1e-5 and len(low.trained) > 3
    step = _FakeTuning(lambda lr: 0.9 if lr < 2e-5 else 0.5)  # extended once, then the new edge ties 1e-5
    assert mutual.tune_grid(step, "f", grid, [0]).overrides["lr"] == 1e-5 and len(step.trained) == 4


def test_a_control_matched_on_a_distill_run_spends_the_scoring_flops_in_own_samples(tiny_config, tmp_path,
                                                                                    monkeypatch):
    """A policy that spent FLOPs scoring its peers' samples in the sharing run gets, in its matched
    control, samples a prompt x (1 + scoring / sampling): sampling then costs what sampling and scoring
    cost (here 8 -> 12); a policy that scored nothing keeps its samples and its config is untouched."""
    import json

    _real_small(monkeypatch)  # benchmarks/ on the path
    import mutual

    from mutualrl.study import Arm, Study

    s = Study("t", lambda seed: dict(tiny_config, grpo={"num_generations": 8}), tmp_path / "runs", results=tmp_path)
    names = [p["name"] for p in tiny_config["policies"]]
    steps = [{"policy": names[0], "flops_sampling": 4e9, "flops_scoring": 2e9, "train_tokens": 100},
             {"policy": names[1], "flops_sampling": 3e9, "flops_scoring": 0.0, "train_tokens": 50}] * 3
    (tmp_path / "t_runs").mkdir()
    (tmp_path / "t_runs" / "best-seed1.json").write_text(json.dumps(
        {"arm": "best", "seed": 1, "policies": names, "steps": steps}))
    best = Arm("best", "sharing", "sharing", {})
    assert s.scoring_samples(best, 1, 8) == {names[0]: 12}
    pols = s.matched_overrides(1, "self_imitate", s.policy_budget(best, 1), mutual.control_samples(s, best, 1))
    assert pols["policies"][0]["grpo"] == {"num_generations": 12} and "grpo" not in pols["policies"][1]
    assert [p["sharing"]["self_imitate"]["match_tokens"] for p in pols["policies"]] == [100, 50]


def test_the_real_pairs_smoke_test_keeps_to_its_own_folders_and_bad_flags_stop_it(monkeypatch):
    """--quick runs in NAME_quick and OUT_quick with its results under OUT_quick (the study's run
    folders and committed results untouched); --evals 1 and a final seed equal to the tuning seed
    stop the script before anything runs; a zero-shot table without a kept type is refused."""
    import sys
    from pathlib import Path

    study = _real_small(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["mutual_real_small.py", "--quick"])
    args = study.checked_args(study.parser())
    assert args.name == "mutual_real_small_quick" and args.out == "runs/study_real_small_quick"
    assert args.results == Path(args.out) / "results" and args.final == [1] and args.steps == 4
    for argv in (["--evals", "1"], ["--final-seeds", "0,1"]):
        monkeypatch.setattr(sys, "argv", ["mutual_real_small.py", *argv])
        with pytest.raises(SystemExit):
            study.checked_args(study.parser())
    a, b = list(study.CANDIDATES)[:2]
    table = _zero_shot_table(study, {"smollm2": [{a: 0.6}, {}], "gemma3": [{b: 0.6}, {}]})
    for rows in table.values():
        for r in rows:
            for ex in study.EXTRACTIONS:
                r["accuracy"][ex].pop(b)
    with pytest.raises(SystemExit, match="no accuracy for"):
        study.choose(table, {}, n=100)


def test_the_final_runs_test_split_is_checked_fresh_before_any_final_seed(monkeypatch):
    """The zoo study's split check: the final seeds' test questions (task.heldout_seed) are in none of
    the tuning seed's splits and are the same on every final seed; a final section without the fresh
    split stops the study before any final seed."""
    _real_small(monkeypatch)  # benchmarks/ on the path
    import mutual

    def section(seed, heldout=True):
        out = {"preset": "zoo", "test_size": 60, "val_size": 60, "train_size": 300, "seed": 0, "reward": "exact"}
        return {**out, "heldout_seed": 99} if seed != 0 and heldout else out

    notes: list[str] = []
    out = mutual.check_split(section, [0], [1, 2], notes)
    assert out["test_questions_in_seed0_splits"] == 0 and out["one_test_split_for_every_final_seed"] is True
    assert out["heldout_seed"] == 99 and out["test_size"] == 60 and "0 of them" in notes[-1]
    with pytest.raises(SystemExit, match="not fresh"):
        mutual.check_split(lambda s: section(s, heldout=False), [0], [1, 2], [])
    with pytest.raises(SystemExit, match="not fresh"):  # final seeds on different test problems
        mutual.check_split(lambda s: {**section(s), "heldout_seed": 99 + s}, [0], [1, 2], [])


def test_the_gate_stops_before_the_final_seeds_when_the_matched_control_is_outside(tmp_path, monkeypatch):
    """mutual.check_inside_match: a matched control within 10 % either way of the sharing arm on
    every policy passes (noted); one policy 12 % short in FLOPs stops the study, naming the control (a
    smoke test notes it and goes on)."""
    import json

    _real_small(monkeypatch)  # benchmarks/ on the path
    import mutual

    from mutualrl.study import Arm, Study

    s = Study("t", lambda seed: {}, tmp_path / "runs", results=tmp_path)  # reads records only: no config
    (tmp_path / "t_runs").mkdir()

    def record(arm: str, flops_b: float) -> None:
        steps = [{"policy": p, "train_tokens": 100, "optimizer_steps": 1, "gen_tokens": 10, "flops_sampling": f,
                  "flops_scoring": 0.0, "flops_update": f} for p, f in (("a", 1e9), ("b", flops_b))]
        (tmp_path / "t_runs" / f"{arm}-seed0.json").write_text(json.dumps(
            {"arm": arm, "seed": 0, "policies": ["a", "b"], "steps": steps}))

    best, good, short = (Arm(n, "x", r, {}) for n, r in (("best", "sharing"), ("good", "baseline"),
                                                          ("short", "baseline")))
    record("best", 1e9)
    record("good", 1.09e9)
    record("short", 0.88e9)
    mutual.check_inside_match(s, good, best, [0])
    assert "inside the match" in s.notes[-1]
    with pytest.raises(SystemExit, match="short is not inside the compute match"):
        mutual.check_inside_match(s, short, best, [0])
    assert "OUTSIDE" in s.notes[-1] and "0.88" in s.notes[-1]
    mutual.check_inside_match(s, short, best, [0], smoke=True)  # a smoke test shows the verdict and goes on
    assert "OUTSIDE" in s.notes[-2] and "smoke test" in s.notes[-1]


def _flops_record(runs, arm: str, per_policy: dict) -> None:
    """A one-step record of ``arm`` on seed 0: ``per_policy`` policy -> (trained tokens, optimizer steps,
    sampling, scoring, update FLOPs)."""
    import json

    steps = [{"policy": p, "step": 0, "train_tokens": t, "optimizer_steps": o, "gen_tokens": 10, "flops_sampling": fs,
              "flops_scoring": fc, "flops_update": fu} for p, (t, o, fs, fc, fu) in per_policy.items()]
    (runs / f"{arm}-seed0.json").write_text(json.dumps(
        {"arm": arm, "seed": 0, "policies": list(per_policy), "steps": steps,
         "evals": [{"policy": p, "step": 1, "val_acc": 0.25} for p in per_policy]}))


def test_the_gate_judges_a_short_policy_on_flops_alone_and_says_so(tmp_path, monkeypatch):
    """Amendment 5: a policy whose own successes cannot reach its budget (``flops_only``) passes the
    gate on FLOPs within 10 % whatever its trained tokens and steps; its FLOPs outside still stop the
    study; the other policy is judged on all three; the note names the policy and the strict verdict."""
    _real_small(monkeypatch)
    import mutual

    from mutualrl.study import Arm, Study, evidence

    s = Study("t", lambda seed: {}, tmp_path / "runs", results=tmp_path)
    runs = tmp_path / "t_runs"
    runs.mkdir()
    best, fed, starved, other = (Arm(n, "x", "baseline", {}) for n in ("best", "fed", "starved", "other"))
    _flops_record(runs, "best", {"a": (100, 1, 5e8, 0.0, 5e8), "b": (100, 1, 2e8, 0.0, 8e8)})
    _flops_record(runs, "fed", {"a": (100, 1, 5e8, 0.0, 5e8), "b": (20, 0, 9.5e8, 0.0, 1e8)})  # b: FLOPs 1.05x
    _flops_record(runs, "starved", {"a": (100, 1, 5e8, 0.0, 5e8), "b": (20, 0, 3e8, 0.0, 1e8)})  # b: FLOPs 0.4x
    _flops_record(runs, "other", {"a": (70, 1, 5e8, 0.0, 3.5e8), "b": (20, 0, 9.5e8, 0.0, 1e8)})  # a short too
    with pytest.raises(SystemExit):  # strictly, b's tokens and steps are outside
        mutual.check_inside_match(s, fed, best, [0])
    mutual.check_inside_match(s, fed, best, [0], flops_only=["b"])
    assert "inside the gate's terms (b judged on FLOPs alone), OUTSIDE the match on all three" in s.notes[-1]
    ratios = {k: v for k, v in evidence.policy_ratios(s.records(fed, [0]) + s.records(best, [0]), "fed",
                                                        "best").items() if k != "flops"}
    assert not mutual.flops_only_inside(ratios, ["b"])  # a FLOPs-only policy without a FLOPs ratio is outside
    with pytest.raises(SystemExit, match="starved is not inside"):
        mutual.check_inside_match(s, starved, best, [0], flops_only=["b"])
    with pytest.raises(SystemExit, match="other is not inside"):  # a is judged on all three
        mutual.check_inside_match(s, other, best, [0], flops_only=["b"])


def test_the_fallback_samples_spend_the_short_policys_flops(tmp_path, monkeypatch):
    """Amendment 5: a short policy samples ``generations x (sharing arm's sampling + scoring + update -
    the control's own update) / sampling`` completions a prompt on that seed, within [generations, 32];
    a policy not short keeps its samples; ``more_samples`` never lowers what scoring already raised."""
    rs = _real_small(monkeypatch)

    from mutualrl.study import Arm, Study

    s = Study("t", lambda seed: {}, tmp_path / "runs", results=tmp_path)
    runs = tmp_path / "t_runs"
    runs.mkdir()
    best = Arm("best", "x", "sharing", {})
    # gemma: sampling 2e8, scoring 1e8, update 9e8 in the sharing arm; its control's update 1e8: 4 x 11/2 = 22
    _flops_record(runs, "best", {"smol": (100, 1, 4e8, 0.0, 4e8), "gemma": (120, 1, 2e8, 1e8, 9e8)})
    assert rs.fallback_samples(s, best, {"gemma": 1e8}, 0, 4) == {"gemma": 22}
    assert rs.fallback_samples(s, best, {"smol": 4e8}, 0, 4) == {"smol": 4}  # update spent alike: no more
    _flops_record(runs, "best", {"smol": (100, 1, 4e8, 0.0, 4e8), "gemma": (120, 1, 1e7, 0.0, 9e8)})
    assert rs.fallback_samples(s, best, {"gemma": 1e8}, 0, 4) == {"gemma": rs.MAX_SAMPLES}
    over = {"policies": [{"name": "smol"}, {"name": "gemma", "grpo": {"num_generations": 30}}]}
    out = rs.more_samples(over, {"gemma": 22})
    assert out["policies"][1]["grpo"]["num_generations"] == 30 and "grpo" not in out["policies"][0]
    assert rs.more_samples(over, {"gemma": 31})["policies"][1]["grpo"]["num_generations"] == 31


def test_the_fallback_replaces_the_chosen_control_resizes_once_and_overrides_what_it_says(tmp_path, monkeypatch):
    """Amendment 5 end to end on synthetic runs (a fake ``Study.run`` whose FLOPs grow with the samples):
    a policy under half its budget is FLOPs-only; the fallback is sized with the chosen candidate's
    update, found outside the FLOPs match, sized once more with its own update and run as ``_resized``
    (never a third time); it becomes the matched control (the tuning record says so), and its overrides
    on a seed carry the schedule, the samples and, for the FLOPs-only policy alone, no ceiling."""
    rs = _real_small(monkeypatch)

    from mutualrl.study import Arm, Study

    base = {"policies": [{"name": "smol"}, {"name": "gemma"}], "grpo": {"num_generations": 4}}
    s = Study("t", lambda seed: base, tmp_path / "runs", results=tmp_path)
    runs = tmp_path / "t_runs"
    runs.mkdir()
    ran: list[str] = []

    def fake_run(pairs):  # gemma: 0.5e8 FLOPs a sample, and its update grows with what it samples
        for arm, seed in pairs:
            n = next((p["grpo"]["num_generations"] for p in arm.seed_overrides[seed]["policies"]
                      if p["name"] == "gemma" and "grpo" in p), 4)
            ran.append(arm.name)
            _flops_record(runs, arm.name, {"smol": (100, 1, 4e8, 0.0, 4e8),
                                           "gemma": (20, 1, 0.5e8 * n, 0.0, 1e8 + 0.3e8 * (n - 4))})

    monkeypatch.setattr(s, "run", fake_run)
    best, held = Arm("best", "x", "sharing", {}), Arm("held", "matched", "baseline", {"sharing": {}})
    _flops_record(runs, "best", {"smol": (100, 1, 4e8, 0.0, 4e8), "gemma": (120, 1, 2e8, 0.0, 9e8)})
    _flops_record(runs, "held", {"smol": (100, 1, 4e8, 0.0, 4e8), "gemma": (20, 1, 2e8, 0.0, 1e8)})
    s.tuning["matched"] = {"chosen": "held"}
    budgets = {0: s.policy_budget(best, 0)}
    tuned = rs.Tuned(s, held, held, best, held, rs.short_policies(s, held, budgets), 4)
    assert tuned.short == ["gemma"]
    tuned = rs.with_fallback(tuned, s, [0], budgets)
    # first 4 x (11 - 1) / 2 = 20 samples: 10e8 + 5.8e8 FLOPs, 1.44x: outside; then 4 x (11 - 5.8) / 2 = 10
    assert ran == ["held_more_samples", "held_more_samples_resized"] and tuned.held.name == ran[-1]
    assert tuned.flops_only == ["gemma"] and tuned.fallback
    assert s.tuning["matched"]["chosen"] == ran[-1] and s.tuning["matched"]["chosen_on_validation"] == "held"
    assert s.tuning["matched"]["fallback"]["samples"] == {0: {"gemma": 10}}
    assert tuned.update == {"gemma": pytest.approx(2.8e8)}  # the resized fallback's own, for the final seeds
    over = tuned.match(0, budgets[0])["policies"]
    smol, gemma = over
    assert gemma["grpo"]["num_generations"] == round(4 * (11e8 - 2.8e8) / 2e8)
    assert gemma["sharing"]["self_imitate"]["match_ceiling"] is False
    assert "match_ceiling" not in smol["sharing"]["self_imitate"] and "grpo" not in smol
    assert smol["sharing"]["self_imitate"]["match_schedule"] == [100]
    assert gemma["sharing"]["self_imitate"]["match_schedule"] == [120]


def test_a_study_run_watches_the_study_that_started_it(monkeypatch, tmp_path):
    """``python -m mutualrl.study.one RUN --parent PID`` watches PID (the harness passes its own), so a
    study killed alone leaves no run training into folders a restarted study would resume."""
    import os

    from mutualrl.study import harness, one

    watched, ran = [], []
    monkeypatch.setattr(one, "exit_when_orphaned", lambda pid: watched.append(pid))
    monkeypatch.setattr(one, "run_one", lambda d, resume: ran.append((d, resume)))
    one.main([str(tmp_path / "r"), "--parent", "4242", "--resume"])
    one.main([str(tmp_path / "r")])
    assert watched == [4242, os.getppid()] and ran == [(tmp_path / "r", True), (tmp_path / "r", False)]
    import inspect

    assert '"--parent", str(os.getpid())' in inspect.getsource(harness.Study._launch)


def test_the_retired_matched_control_is_noted_beside_the_headline_not_in_it(tmp_path, monkeypatch):
    """mutual.retired_final_note: the uncapped control amendment 3 retired is reported in the notes
    (its seeds, test accuracy, trained tokens over the sharing arm's per policy); nothing without it."""
    import json

    _real_small(monkeypatch)  # benchmarks/ on the path
    import mutual

    from mutualrl.study import Arm, Study

    s = Study("t", lambda seed: {}, tmp_path / "runs", results=tmp_path)
    (tmp_path / "t_runs").mkdir()
    best = Arm("best", "sharing", "sharing", {})
    mutual.retired_final_note(s, best, [1])
    assert s.notes == []
    for arm, tokens, acc in (("best", 100, 0.7), (mutual.RETIRED_FINAL, 138, 0.6)):
        (tmp_path / "t_runs" / f"{arm}-seed1.json").write_text(json.dumps(
            {"arm": arm, "seed": 1, "policies": ["a"], "evals": [{"policy": "a", "step": 3, "test_acc": acc}],
             "steps": [{"policy": "a", "train_tokens": tokens, "optimizer_steps": 1, "gen_tokens": 5}]}))
    mutual.retired_final_note(s, best, [1])
    assert "self_imitate_matched on seeds [1], test accuracy [60.0]" in s.notes[-1] and "{'a': [1.38]}" in s.notes[-1]
