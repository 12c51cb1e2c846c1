"""The comparison report from run directories: numbers, per-skill table, figure."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from mutualrl.study.report import load_run, summarize, write_report


def _run(root: Path, strategy: str, seed: int, final: dict[str, dict[str, float]], rescue: int = 0,
         val: dict[str, float] | None = None, arm: str | None = None) -> Path:
    d = root / f"{arm or strategy}-seed{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"sharing": {"strategy": strategy}, "seed": seed,
                                                   "task": {"preset": "zoo"},
                                                   "policies": [{"name": "a", "model": "zoo:gpt2-add"},
                                                                {"name": "b", "model": "zoo:llama-sub"}]}))
    rows = []
    start = {"a": {"add": 0.4, "sub": 0.0}, "b": {"add": 0.1, "sub": 0.5}}
    for step, acc in ((0, start), (10, final)):
        for p, sk in acc.items():
            split = "val" if val is not None else "test"
            row = {"event": "eval", "policy": p, "step": step, f"{split}_acc": sum(sk.values()) / 2,
                   **{f"{split}_acc/{k}": v for k, v in sk.items()}}
            if val is not None and step == 10:  # the test split read once, at the end
                row.update({"val_acc": val[p], "test_acc": sum(sk.values()) / 2,
                            **{f"test_acc/{k}": v for k, v in sk.items()}})
            rows.append(row)
    for step in range(10):
        for p in ("a", "b"):
            rows.append({"policy": p, "step": step, "reward_mean": 0.1 * step, "peer_rows": rescue,
                         "train_tokens": 100 + 10 * rescue, "optimizer_steps": 1 + bool(rescue)})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if arm:
        (d / "arm.json").write_text(json.dumps({"arm": arm}))
    return d


def test_report_numbers_per_skill_table_and_figure(tmp_path):
    runs = [_run(tmp_path, "independent", 0, {"a": {"add": 0.6, "sub": 0.0}, "b": {"add": 0.1, "sub": 0.7}}),
            _run(tmp_path, "independent", 1, {"a": {"add": 0.6, "sub": 0.2}, "b": {"add": 0.1, "sub": 0.7}}),
            _run(tmp_path, "sgt", 0, {"a": {"add": 0.6, "sub": 0.4}, "b": {"add": 0.3, "sub": 0.7}}, rescue=2)]
    s = summarize([load_run(d) for d in runs])
    # average start (0.2 + 0.3) / 2 = 0.25; independent ends at 0.35 / 0.40, sgt at 0.50
    assert abs(s["independent"]["avg_gain_pts"]["mean"] - 12.5) < 1e-9
    assert [round(v, 9) for v in s["independent"]["avg_gain_pts"]["values"]] == [10.0, 15.0]
    assert abs(s["sgt"]["avg_test_acc_final"]["mean"] - 0.5) < 1e-9
    assert s["sgt"]["per_policy_skill_final"]["a"]["sub"]["mean"] == 0.4
    assert s["sgt"]["peer_rows_total"]["a"]["mean"] == 20  # 2 per step over 10 steps
    assert s["sgt"]["compute_per_run"]["trained_tokens"]["mean"] == 2400 and not s["sgt"]["single_model"]

    out = write_report(runs, tmp_path / "report")
    md = (out / "report.md").read_text() if out.is_dir() else out.read_text()
    lines = md.splitlines()
    indep = next(ln for ln in lines if ln.startswith("| independent | 0."))
    sgt = next(ln for ln in lines if ln.startswith("| sgt | 0."))
    assert "0.375 ± 0.035" in indep  # two seeds: mean and sample std
    assert "±" not in sgt.split("|")[3] and "| 2,400 | 40 |" in sgt  # one seed: no spread; tokens, steps
    assert "no peers' share is claimed" in md  # no validation split: no choice, no claim
    assert any(ln.startswith("| sgt | a |") and "0.000 → 0.400" in ln and ln.rstrip().endswith("| 20 |")
               for ln in lines)
    assert (tmp_path / "report" / "curves.png").stat().st_size > 10_000


def test_a_policy_whose_skills_start_equal_has_no_own_skill_to_lose(tmp_path):
    """Gemma-3 on the real-model study starts at 1.5 % on both types: the transfer table names its
    weak skill and no own-skill cost, instead of calling the same type both."""
    from mutualrl.study.report import own_and_weak, transfer_section

    runs = [_run(tmp_path, "independent", 0, {"a": {"add": 0.6, "sub": 0.0}, "b": {"add": 0.1, "sub": 0.7}}),
            _run(tmp_path, "sgt", 0, {"a": {"add": 0.6, "sub": 0.4}, "b": {"add": 0.3, "sub": 0.7}})]
    loaded = [load_run(d) for d in runs]
    for run in loaded:
        for r in run["evals"]:
            if r["policy"] == "b" and r["step"] == 0:
                r["test_acc/add"] = r["test_acc/sub"] = 0.25
    assert own_and_weak(loaded[0], "a") == ("add", "sub")
    own, weak = own_and_weak(loaded[0], "b")
    assert own is None and weak in ("add", "sub")
    rows = transfer_section(summarize(loaded), loaded)
    b = next(ln for ln in rows if ln.startswith("| sgt | b |"))
    assert "— (all types equal at step 0)" in b
    a = next(ln for ln in rows if ln.startswith("| sgt | a |"))
    assert "+40.0 (sub)" in a and "+0.0 (add)" in a


def test_the_report_leads_with_the_peers_share_chosen_on_validation(tmp_path):
    """Sharing arms against single-model arms: each side's best by validation, the difference on test,
    paired per seed, with the t interval; an arm's label comes from its arm.json."""
    from mutualrl.study.report import share_of_peers

    runs = []
    for seed, (ind, ctrl, shr) in enumerate([(0.30, 0.34, 0.40), (0.32, 0.35, 0.43), (0.31, 0.33, 0.41)]):
        for arm, strategy, acc, val in (("independent", "independent", ind, 0.2), ("control", "self_imitate", ctrl, 0.3),
                                        ("sharing", "imitate", shr, 0.5), ("worse", "sgt", shr + 0.1, 0.1)):
            runs.append(_run(tmp_path, strategy, seed, {"a": {"add": acc, "sub": acc}, "b": {"add": acc, "sub": acc}},
                             rescue=1 if strategy in ("imitate", "sgt") else 0, val={"a": val, "b": val}, arm=arm))
    loaded = [load_run(d) for d in runs]
    share = share_of_peers(loaded)
    # 'worse' has the best test figure but the lower validation one: never chosen
    assert share["best_sharing_arm"] == "sharing" and share["strongest_baseline"] == "control"
    assert share["values"] == [pytest.approx(v) for v in (6.0, 8.0, 8.0)]
    mean, sd = 22 / 3, statistics.stdev([6.0, 8.0, 8.0])
    assert share["mean"] == pytest.approx(mean)
    assert share["ci95"] == pytest.approx([mean - 4.303 * sd / 3 ** 0.5, mean + 4.303 * sd / 3 ** 0.5])
    md = (write_report(runs, tmp_path / "rep")).read_text()
    lead = md.split("## The peers' share", 1)[1].split("|", 1)[0]
    assert "**sharing**" in lead and "**control**" in lead and "+7.3 points" in lead and "[+4.5, +10.2]" in lead
    assert md.index("## The peers' share") < md.index("| arm |")
