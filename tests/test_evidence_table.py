"""The evidence table and figure on small synthetic records (no training): the headline arms, the
per-policy compute ratios and match, the target's verdict, the README block, the figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mutualrl.study import evidence_table as et
from mutualrl.study.aggregate import aggregate
from mutualrl.study.evidence import compute_by_policy, policy_ratios
from mutualrl.study.records import write_record

POLICIES = ("p", "q")


def run(arm: str, role: str, seed: int, test: float, val: float, tokens: dict[str, int], steps: int = 3,
        opt: int = 2, flops: dict[str, float] | None = None) -> dict:
    """A compact record: ``steps`` steps per policy, each training ``tokens[policy]`` tokens with
    ``opt`` optimizer steps (and FLOPs by phase when ``flops`` is given); one final eval row per policy."""
    rows = []
    for k in range(steps):
        for p in POLICIES:
            row = {"step": k, "policy": p, "train_tokens": tokens[p], "optimizer_steps": opt, "gen_tokens": 100}
            if flops is not None:
                row |= {"flops_sampling": flops[p] / 2, "flops_scoring": 0.0, "flops_update": flops[p] / 2}
            rows.append(row)
    evals = [{"event": "eval", "policy": p, "step": steps, "test_acc": test, "val_acc": val} for p in POLICIES]
    return {"arm": arm, "family": arm, "role": role, "seed": seed, "overrides": {}, "git_rev": "abc", "load_avg": None,
            "policies": list(POLICIES), "strategy": "x", "wall_s": 1.0, "config": {}, "evals": evals, "steps": rows}


def records(flops: bool = False) -> list[dict]:
    """Three seeds of: a sharing arm; a control matched on the pair's sum but not per policy (the
    strongest baseline); a control matched per policy; plain GRPO; a half-budget arm (not headline)."""
    out = []
    for seed, (s, m) in enumerate([(0.70, 0.63), (0.72, 0.64), (0.69, 0.65)]):
        f = {"p": 10.0, "q": 10.0} if flops else None
        out += [run("share", "sharing", seed, s, s, {"p": 100, "q": 100}, flops=f),
                run("sum_matched", "baseline", seed, m, m + 0.05, {"p": 60, "q": 140}, flops=f),
                run("matched", "baseline", seed, m - 0.01, m, {"p": 95, "q": 104}, flops=f),
                run("grpo", "baseline", seed, 0.6, 0.6, {"p": 50, "q": 50}, opt=1, flops=f),
                run("half", "half_baseline", seed, 0.6, 0.6, {"p": 50, "q": 50})]
    return out


@pytest.fixture
def study(tmp_path: Path) -> tuple[dict, list[dict]]:
    """The synthetic records aggregated by the study library itself (so the JSON has its real shape)."""
    runs = records()
    for r in runs:
        write_record(tmp_path / "syn_runs", r)
    return aggregate(tmp_path, "syn"), runs


def test_headline_arms_best_strongest_then_other_baselines(study):
    result, _ = study
    assert result["peers_share"]["best_sharing_arm"] == "share"
    # the headline's baseline: the strongest on validation inside the match (sum_matched is stronger, but
    # trains 0.6x / 1.4x the sharing arm's tokens per policy); the strongest whatever its compute beside it
    assert result["peers_share"]["strongest_baseline"] == "matched" and result["peers_share"]["inside_match"]
    assert result["peers_share_any_compute"]["strongest_baseline"] == "sum_matched"
    arms = et.headline_arms(result)
    assert arms[:2] == ["share", "matched"]
    assert set(arms[2:]) == {"sum_matched", "grpo"} and "half" not in arms
    assert et.headline_arms({"arms": {"a": {"role": "baseline"}}}) == ["a"]


def test_policy_compute_sums_per_policy_and_flops_only_when_counted():
    plain = compute_by_policy(run("a", "sharing", 0, 0.5, 0.5, {"p": 10, "q": 20}, steps=4, opt=2))
    assert plain == {"p": {"trained_tokens": 40.0, "optimizer_steps": 8.0, "sampled_tokens": 400.0},
                     "q": {"trained_tokens": 80.0, "optimizer_steps": 8.0, "sampled_tokens": 400.0}}
    counted = compute_by_policy(run("a", "sharing", 0, 0.5, 0.5, {"p": 10, "q": 20}, steps=2,
                                    flops={"p": 3.0, "q": 5.0}))
    assert counted["p"]["flops"] == pytest.approx(6.0) and counted["q"]["flops"] == pytest.approx(10.0)


def test_a_control_matched_on_the_sum_is_not_matched_per_policy():
    runs = records()
    sum_ratios = policy_ratios(runs, "sum_matched", "share")
    assert sum_ratios["trained_tokens"]["p"]["mean"] == pytest.approx(0.6)
    assert sum_ratios["trained_tokens"]["q"]["mean"] == pytest.approx(1.4)
    assert sum_ratios["seeds"] == [0, 1, 2]
    verdict = et.match_verdict(sum_ratios)
    assert verdict["inside"] is False and verdict["outside"] == ["trained_tokens"]
    assert abs(verdict["worst"]["trained_tokens"] - 1) == pytest.approx(0.4)
    assert verdict["flops_compared"] is False
    matched = et.match_verdict(policy_ratios(runs, "matched", "share"))
    assert matched["inside"] is True and matched["outside"] == []
    grpo = et.match_verdict(policy_ratios(runs, "grpo", "share"))
    assert grpo["outside"] == ["trained_tokens", "optimizer_steps"]
    assert et.match_verdict({})["inside"] is None
    assert et.match_verdict(policy_ratios(runs, "matched", "nobody"))["inside"] is None


def test_flops_compared_only_when_both_counted():
    runs = records(flops=True)
    ratios = policy_ratios(runs, "matched", "share")
    assert ratios["flops"]["p"]["mean"] == pytest.approx(1.0)
    assert et.match_verdict(ratios)["flops_compared"] is True
    mixed = [r for r in runs if r["arm"] != "grpo"] + [r for r in records() if r["arm"] == "grpo"]
    assert "flops" not in policy_ratios(mixed, "grpo", "share")
    assert et.match_verdict(policy_ratios(mixed, "grpo", "share"))["flops_compared"] is False


def test_only_final_seeds_count():
    runs = records() + [run("sum_matched", "baseline", 9, 0.1, 0.1, {"p": 100, "q": 100}),
                        run("share", "sharing", 9, 0.1, 0.1, {"p": 100, "q": 100})]
    chosen = policy_ratios(runs, "sum_matched", "share", seeds=[0, 1, 2])
    assert chosen["seeds"] == [0, 1, 2] and len(chosen["trained_tokens"]["p"]["values"]) == 3
    assert len(policy_ratios(runs, "sum_matched", "share")["trained_tokens"]["p"]["values"]) == 4


def test_target_verdict_states_every_reason():
    share = {"mean": 6.0, "ci95": [4.2, 7.8]}
    assert et.target_verdict(share, 5.0, True, 5)["met"] is True
    v = et.target_verdict(share, 5.0, False, 3)
    assert v["met"] is False
    assert v["reasons"] == ["baseline not compute-matched per policy", "3 final seeds (< 5)"]
    assert v["lower_bound_below_target"] is True
    w = et.target_verdict({"mean": 2.0, "ci95": [-1.0, 5.0]}, 3.0, None, 5)
    assert w["reasons"] == ["mean +2.0 below the target", "95 % interval touches 0", "per-policy compute match unknown"]
    assert et.target_verdict(None, 3.0, True, 5) == {"target": 3.0, "met": False, "reasons": ["no peers' share"]}
    assert et.target_verdict(share, None, True, 5)["met"] is None


def test_rows_and_markdown(study):
    result, runs = study
    rows = et.study_rows("syn", result, runs, target=5.0)
    assert [r["arm"] for r in rows][:2] == ["share", "matched"]
    best, strong = rows[0], rows[1]
    assert best["peers_share"]["mean"] == pytest.approx(result["peers_share"]["mean"])
    assert all(r["peers_share"] is None for r in rows[1:])
    assert best["test_acc"] == pytest.approx((0.70 + 0.72 + 0.69) / 3)
    assert best["match"] is None and strong["match"]["inside"] is True
    assert next(r for r in rows if r["arm"] == "sum_matched")["match"]["inside"] is False
    # the share is +7.3 > 5 with an interval above 0 against a matched baseline, yet missed: 3 seeds
    assert result["peers_share"]["mean"] == pytest.approx(100 * (2.11 - 1.89) / 3)
    assert best["target"]["met"] is False and best["target"]["reasons"] == ["3 final seeds (< 5)"]
    assert best["target"]["power"]["seeds_at_target"] >= 2
    md = et.markdown(rows)
    lines = md.splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "p 0.60, q 1.40" in md
    assert "n/a" in lines[3]  # FLOPs not counted in these records
    assert "**missed**" in lines[2] and "[" in lines[2] and "power at the target" in lines[2]
    assert "yes (FLOPs n/a)" in lines[3]  # the per-policy matched control
    # beside the headline: the strongest baseline whatever its compute (stronger on validation, outside)
    anyc = result["peers_share_any_compute"]
    assert best["peers_share_any_compute"]["strongest_baseline"] == anyc["strongest_baseline"] == "sum_matched"
    assert f"vs the strongest whatever its compute (sum_matched): {anyc['mean']:+.1f}" in lines[2]
    assert all("peers_share_any_compute" not in r for r in rows[1:])


def test_missing_fields_read_na():
    study = {"arms": {"b": {"role": "baseline", "seeds": [0], "test_final": {}}}}
    rows = et.study_rows("old", study, [], target=3.0)
    assert len(rows) == 1 and rows[0]["test_acc"] is None and rows[0]["target"] is None
    assert rows[0]["match"]["inside"] is None
    assert "(reference)" not in et.markdown(rows) and "n/a" in et.markdown(rows)


def test_no_baseline_inside_the_match(study):
    result, runs = study
    cut = {**result, "peers_share": {"best_sharing_arm": "share", "strongest_baseline": None,
                                     "baselines_inside_match": []}}
    rows = et.study_rows("syn", cut, runs, target=5.0)
    assert rows[0]["arm"] == "share" and rows[0]["peers_share"] is None
    assert rows[0]["target"]["reasons"] == ["no baseline inside the per-policy match"]
    assert "**missed**" in et.markdown(rows)
    assert et.figure_panel("syn", cut)["title"] == "syn"


def test_a_study_whose_final_seeds_have_not_all_run_reads_pending_not_missed():
    study = {"arms": {}, "final_seeds": [1, 2, 3, 4, 5],
             "target": {"target": 3.0, "met": None, "reasons": ["pending: a, b not yet on every final seed"]}}
    rows = et.study_rows("mix", study, [], target=3.0)
    assert len(rows) == 1 and rows[0]["target"]["met"] is None
    md = et.markdown(rows)
    assert "pending: a, b" in md and "missed" not in md


def test_replace_block():
    text = f"# t\n\nbefore\n{et.START}\nold table\n{et.END}\nafter\n"
    out = et.replace_block(text, "| new |\n")
    assert out == f"# t\n\nbefore\n{et.START}\n| new |\n{et.END}\nafter\n"
    assert et.replace_block(out, "| newer |") == out.replace("| new |", "| newer |")
    with pytest.raises(ValueError):
        et.replace_block("no markers", "x")
    with pytest.raises(ValueError):
        et.replace_block(f"{et.END}\n{et.START}", "x")
    with pytest.raises(ValueError):
        et.replace_block(f"{et.START}{et.START}{et.END}", "x")


def test_figure_panel_and_png(study, tmp_path):
    result, _ = study
    panel = et.figure_panel("syn", result, target=5.0)
    arms = {a["arm"]: a for a in panel["arms"]}
    assert list(arms)[:2] == ["share", "matched"]
    assert arms["share"]["values"] == pytest.approx([70.0, 72.0, 69.0])
    assert arms["matched"]["difference"] is None
    assert arms["share"]["difference"]["values"] == pytest.approx(result["peers_share"]["values"])
    lo, hi = arms["share"]["ci95"]
    assert lo < arms["share"]["mean"] < hi
    path = et.draw_figure([panel, panel], tmp_path / "fig.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_committed_studies_render():
    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    from mutualrl.study.records import load_records

    found = 0
    for name in ("mutual", "mutual_taskmix", "mutual_real_small"):
        path = results / f"{name}.json"
        if not path.is_file():
            continue
        study = json.loads(path.read_text())
        rows = et.study_rows(name, study, load_records(results / f"{name}_runs"), 5.0)
        assert rows and et.markdown(rows).count("\n") == len(rows) + 1
        found += 1
    if not found:
        pytest.skip("no committed study JSON")


def test_a_control_that_samples_more_to_match_scoring_flops_is_inside_and_says_so():
    """Tokens, steps and FLOPs decide the match; sampled tokens outside 10 % are reported beside it."""
    ratios = {"seeds": [0], "trained_tokens": {"p": {"values": [1.02]}}, "optimizer_steps": {"p": {"values": [1.0]}},
              "sampled_tokens": {"p": {"values": [1.5]}}, "flops": {"p": {"values": [0.99]}}}
    verdict = et.match_verdict(ratios)
    assert verdict["inside"] is True and verdict["outside"] == ["sampled_tokens"]
    assert et._match_text(verdict) == "yes; sampled 1.50"
    ratios["flops"]["p"]["values"] = [0.85]
    verdict = et.match_verdict(ratios)
    assert verdict["inside"] is False and et._match_text(verdict) == "no: FLOPs 0.85; sampled 1.50"


def test_the_match_is_judged_either_way_round():
    """10 % means neither arm spent more than 1.1x the other: the same verdict for a / b and b / a."""
    from mutualrl.study.evidence import spread, within

    for r in (1.0, 1.1, 1 / 1.1, 0.95, 1.05):
        assert within(r) and within(1 / r)
    for r in (0.905, 1.105, 0.5, 2.0):
        assert not within(r) and not within(1 / r)
    assert not within(0.0) and spread(0.8) == pytest.approx(1.25)
    ratios = {"seeds": [0], "trained_tokens": {"p": {"values": [0.905]}}, "optimizer_steps": {"p": {"values": [1.0]}}}
    verdict = et.match_verdict(ratios)
    assert verdict["inside"] is False and verdict["worst"]["trained_tokens"] == pytest.approx(0.905)


def test_a_missed_target_states_the_seeds_power_asks_for():
    from mutualrl.study.power import seeds_for_power

    share = {"mean": 2.0, "sd": 4.0, "ci95": [-1.0, 5.0]}
    v = et.target_verdict(share, 3.0, True, 5)
    assert v["met"] is False and v["power"]["seeds_at_target"] == seeds_for_power(4.0, 3.0)
    text = et._target_text(v)
    assert f"{seeds_for_power(4.0, 3.0)} seeds for 80% power at the target, sd 4.0" in text
    met = et.target_verdict({"mean": 6.0, "sd": 1.0, "ci95": [5.5, 6.5]}, 5.0, True, 5)
    assert met["met"] is True and "power" not in met


def test_a_run_that_spent_nothing_on_a_policy_is_outside_whichever_way_round():
    """A control that never trained one policy (0 tokens, or no step rows for it) is outside the match
    both as control / sharing and as sharing / control: no quantity is left out for a zero."""
    from mutualrl.study.evidence import NOTHING_SPENT, inside_match

    share = run("share", "sharing", 0, 0.7, 0.7, {"p": 100, "q": 100})
    idle = run("idle", "baseline", 0, 0.6, 0.6, {"p": 100, "q": 0})
    for a, b in (("share", "idle"), ("idle", "share")):
        ratios = policy_ratios([share, idle], a, b)
        assert not inside_match(ratios) and et.match_verdict(ratios)["inside"] is False
    assert policy_ratios([share, idle], "share", "idle")["trained_tokens"]["q"]["values"] == [NOTHING_SPENT]
    gone = {**idle, "arm": "gone", "steps": [s for s in idle["steps"] if s["policy"] == "p"]}
    for a, b in (("share", "gone"), ("gone", "share")):
        assert not inside_match(policy_ratios([share, gone], a, b))
    assert policy_ratios([share, share | {"arm": "twin"}], "twin", "share")["trained_tokens"]["q"]["values"] == [1.0]
