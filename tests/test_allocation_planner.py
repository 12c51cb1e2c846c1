"""MWRA cost model and planner: unit tests (no processes, no models loaded)."""

from __future__ import annotations

import pytest

from mutualrl.allocation.cost import CostModel, predict_step, rollout_flops, update_flops
from mutualrl.allocation.planner import (
    GPUDevice,
    NodeResources,
    Resources,
    balanced_shares,
    evaluate_allocation,
    plan,
    plan_equal,
    realised_shares,
    shares_to_threads,
    should_replan,
)
from mutualrl.config.resolve import load_config


def _cfg(n: int = 2, **over):
    data = {"policies": [{"name": f"p{i}", "model": f"/nonexistent/m{i}"} for i in range(n)],
            "task": {"preset": "zoo"}, "grpo": {"num_generations": 4, "max_completion_length": 8},
            "prompts_per_step": 4, **over}
    return load_config(data, check_paths=False)


def test_cost_proportional_to_params_times_tokens():
    assert rollout_flops(2_000, 4, 4, 0, 8) == pytest.approx(2 * rollout_flops(1_000, 4, 4, 0, 8))
    assert rollout_flops(1_000, 4, 4, 0, 16) == pytest.approx(2 * rollout_flops(1_000, 4, 4, 0, 8))
    # 6 (forward + backward) per iteration; the old log-probs are the first iteration's forward
    assert update_flops(1_000, 16, 8, 1) == pytest.approx(6 * 1_000 * 16 * 8)
    assert update_flops(1_000, 16, 8, 2) == pytest.approx(2 * update_flops(1_000, 16, 8, 1))
    assert update_flops(1_000, 16, 8, 1, beta=0.1) > update_flops(1_000, 16, 8, 1)
    cfg = _cfg()
    a, b = predict_step(cfg, 0, 4_000_000), predict_step(cfg, 0, 1_000_000)
    assert a.total_flops == pytest.approx(4 * b.total_flops)


def test_balanced_shares_equalise_amdahl_times():
    costs = [4.0, 1.0]
    for f in (1.0, 0.9, 0.5):
        s = balanced_shares(costs, 8, f)
        assert sum(s) == pytest.approx(8)
        t = [c * ((1 - f) + f / x) for c, x in zip(costs, s)]
        assert t[0] == pytest.approx(t[1], rel=1e-6)


def test_threads_integer_and_realised_shares():
    threads, nice = shares_to_threads([1.64, 0.36], 2)
    assert all(isinstance(t, int) and t >= 1 for t in threads)
    got = realised_shares(threads, nice, 2)
    assert sum(got) == pytest.approx(2)
    assert got[0] > got[1]
    # whole shares that fit: no oversubscription, no nice
    assert shares_to_threads([3.0, 1.0], 4) == ([3, 1], [0, 0])


def test_planned_imbalance_below_equal_split():
    cfg = _cfg()
    costs = CostModel(cfg, [4_000_000, 1_000_000])
    for cores in (2, 4, 8):
        res = Resources(float(cores))
        naive, planned = plan_equal(cfg, res, costs), plan(cfg, res, costs)
        assert naive.predicted_imbalance > 3
        assert planned.predicted_imbalance < naive.predicted_imbalance
        assert planned.predicted_imbalance <= 1.25
        assert planned.predicted_step_s < naive.predicted_step_s
        assert all(p.threads >= 1 for p in planned.placements)
    text = plan(cfg, Resources(8.0), costs).describe()
    assert "p0" in text and "p1" in text and "imbalance" in text


def test_calibration_and_replan():
    cfg = _cfg()
    costs = CostModel(cfg, [1_000_000, 1_000_000])  # equal by parameters ...
    res = Resources(8.0)
    first = plan(cfg, res, costs)
    assert first.predicted_imbalance == pytest.approx(1.0, abs=0.05)
    for _ in range(3):  # ... but policy 0 measures 4x slower per FLOP
        costs.observe(0, {"rollout_s": 4.0, "gen_tokens": 128}, {"update_s": 8.0, "train_tokens": 128}, 4.0,
                      rollout_cpu_s=8.0, update_cpu_s=16.0)
        costs.observe(1, {"rollout_s": 1.0, "gen_tokens": 128}, {"update_s": 2.0, "train_tokens": 128}, 4.0,
                      rollout_cpu_s=2.0, update_cpu_s=4.0)
    assert costs.calibrated
    assert sum(costs.core_seconds(0)) == pytest.approx(4 * sum(costs.core_seconds(1)), rel=1e-6)
    assert evaluate_allocation(first, costs).predicted_imbalance > 2
    new = should_replan(first, costs, res, threshold=1.25)
    assert new is not None and new.predicted_imbalance < 1.25
    assert new.placements[0].threads > new.placements[1].threads
    assert should_replan(new, costs, res, threshold=1.25) is None


def test_gpu_and_ray_node_plans():
    cfg = _cfg(3)
    costs = CostModel(cfg, [4_000_000, 2_000_000, 1_000_000])
    whole = plan(cfg, Resources(8.0, [GPUDevice(i, 80) for i in range(3)]), costs)
    assert sorted(p.gpu for p in whole.placements) == [0, 1, 2]
    assert all(p.gpu_fraction == 1.0 for p in whole.placements)
    shared = plan(cfg, Resources(8.0, [GPUDevice(0, 80)]), costs)
    assert sum(p.gpu_fraction for p in shared.placements) == pytest.approx(1.0, abs=1e-3)
    nodes = [NodeResources("n1", 2.0), NodeResources("n2", 2.0)]
    ray_plan = plan(_cfg(2), Resources(4.0, [], nodes), CostModel(_cfg(2), [1_000_000, 1_000_000]))
    assert {p.node for p in ray_plan.placements} == {"n1", "n2"}


def test_resources_parse_and_detect():
    r = Resources.parse("cpus=16,gpus=2x40")
    assert r.cpus == 16 and len(r.gpus) == 2 and r.gpus[1].memory_gb == 40
    with pytest.raises(ValueError):
        Resources.parse("tpus=3")
    assert Resources.detect().cpus >= 1


def test_plan_cli(tiny_models, tmp_path, capsys):
    import yaml

    from mutualrl.cli import main

    cfg = {"policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                        {"name": "b", "model": str(tiny_models["tiny-llama"])}],
           "task": {"preset": "zoo"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(path), "--resources", "cpus=4"]) == 0
    out = capsys.readouterr().out
    assert "MWRA plan: 4 CPU" in out and "a " in out and "b " in out


def test_plan_calibrate_plans_from_measured_steps(tiny_config, tmp_path, capsys):
    """``mutualrl plan --calibrate``: each policy's real steps are timed first and the plan is made from
    them (calibrated, every policy measured), not from the FLOP prior."""
    import json

    import yaml

    from mutualrl.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(dict(tiny_config, threads=1)))
    assert main(["plan", str(cfg), "--resources", "cpus=2", "--calibrate", "1", "--json"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert got["plan"]["calibrated"] is True
    assert all(p["measured_steps"] == 1 for p in got["costs"]["policies"])
    assert out.err.count("calibrated ") == 2
    assert main(["plan", str(cfg), "--calibrate", "0"]) == 2  # a positive number of steps
    # on GPUs the split is priced from the prior's per-device speed: CPU seconds measured here would be
    # scaled by it (predictions ~1000x too small), so the plan says it skipped the calibration, as a run does
    assert main(["plan", str(cfg), "--resources", "cpus=2,gpus=1x80", "--calibrate", "1", "--json"]) == 0
    out = capsys.readouterr()
    assert "skipped on GPUs" in out.err and json.loads(out.out)["plan"]["calibrated"] is False


def test_a_calibration_for_ranks_times_one_ranks_share_and_predicts_it(tiny_config):
    """A policy on N ranks is calibrated on 1/N of the step's prompts (a rank's share: per-token costs
    do not shrink with the batch), and the cost the planner gives one rank on the calibration's
    threads (the whole step's seconds / N) is that measured step."""
    from mutualrl.allocation.calibrate import calibrate
    from mutualrl.allocation.cost import estimate_parameters

    cfg = load_config({**tiny_config, "prompts_per_step": 4}, check_paths=False)
    costs = CostModel(cfg, estimate_parameters(cfg))
    got = calibrate(cfg, costs, steps=2, threads=1, ranks=[2, 1])
    assert [g["prompts"] for g in got] == [2, 4] and [g["steps_kept"] for g in got] == [1, 1]
    assert sum(costs.seconds(0, 1.0)) / 2 == pytest.approx(got[0]["step_s"], rel=1e-6)
    assert sum(costs.seconds(1, 1.0)) == pytest.approx(got[1]["step_s"], rel=1e-6)


def test_a_ranks_calibration_and_its_merged_online_steps_are_on_one_scale(tiny_config):
    """One rank measured alone (the calibration: ``shard``) and the same rank's figures merged over
    both ranks online (counts and CPU summed, wall times the slowest rank's: ``rank_times``) give the
    cost model the same prediction."""
    from mutualrl.allocation.cost import estimate_parameters

    cfg = load_config({**tiny_config, "prompts_per_step": 4}, check_paths=False)
    roll = {"rollout_s": 0.30, "gen_tokens": 40}
    upd = {"update_s": 0.50, "train_tokens": 60}
    a = CostModel(cfg, estimate_parameters(cfg), alpha=1.0)
    a.observe(0, roll, upd, 1.0, rollout_cpu_s=0.28, update_cpu_s=0.45, shard=2)
    before = a.seconds(0, 1.0)
    merged_r = {"rollout_s": 0.30, "gen_tokens": 80}
    merged_u = {"update_s": 0.50, "train_tokens": 120}
    a.observe(0, merged_r, merged_u, 1.0, rollout_cpu_s=0.56, update_cpu_s=0.90, rank_times=2)
    assert a.seconds(0, 1.0) == pytest.approx(before, rel=1e-9)


def test_the_ranks_allreduce_is_calibrated_apart_from_their_compute(tiny_config):
    """Merged rank replies carry the all-reduce (``allreduce_s_min``: the transfer, without waiting for
    the slowest rank): the cost model takes it out of the update, calibrates the bandwidth from it,
    and the planner's step on the same layout (compute / N + the all-reduce) is the measured step;
    before any measurement the all-reduce is the prior bandwidth's."""
    from mutualrl.allocation.cost import estimate_parameters
    from mutualrl.allocation.data_parallel import CPU_ALLREDUCE_GB_S, allreduce_seconds

    cfg = load_config({**tiny_config, "prompts_per_step": 4, "scheduler": "local", "policies": [
        {**tiny_config["policies"][0], "workers": 2}, tiny_config["policies"][1]]}, check_paths=False)
    costs = CostModel(cfg, estimate_parameters(cfg), alpha=1.0)
    params = costs.effective_params(0)
    assert costs.allreduce_s(0, 2) == pytest.approx(allreduce_seconds(params, 2, CPU_ALLREDUCE_GB_S))
    roll = {"rollout_s": 0.30, "gen_tokens": 80}
    upd = {"update_s": 0.50, "train_s": 0.45, "train_tokens": 120, "allreduce_s": 0.12, "allreduce_s_min": 0.08}
    costs.observe(0, roll, upd, 0.5, rollout_cpu_s=0.56, update_cpu_s=0.90, rank_times=2)
    assert costs.allreduce_s(0, 2) == pytest.approx(0.08)
    assert costs.to_dict()["policies"][0]["allreduce_gb_s"] == pytest.approx(
        allreduce_seconds(params, 2, 1.0) / 0.08)
    r, u = costs.seconds(0, 0.5)
    assert r / 2 + u / 2 + costs.allreduce_s(0, 2) == pytest.approx(0.30 + 0.50, rel=1e-9)
    assert costs.allreduce_s(1, 2) == pytest.approx(  # the other policy: still the prior
        allreduce_seconds(costs.effective_params(1), 2, CPU_ALLREDUCE_GB_S))


def test_the_cost_model_prices_a_policys_own_sharing_overrides():
    """A policy that trains on more peer rollouts per prompt (its ``policies[i].sharing`` override)
    costs more to update than its twin on the run's setting, and the cost model reads the very
    settings objects the plan hands each worker."""
    from mutualrl.config.resolve import plan_of

    policies = [{"name": f"p{i}", "model": "/nonexistent/m"} for i in range(2)]
    policies[1]["sharing"] = {"prp": {"max_per_prompt": 2}}
    cfg = _cfg(policies=policies, sharing={"strategy": "prp", "prp": {"max_per_prompt": 0}})
    plan = plan_of(cfg)
    assert plan.spec(0).sharing["prp"].max_per_prompt == 0 and plan.spec(1).sharing["prp"].max_per_prompt == 2
    costs = CostModel(cfg, [1000, 1000], settings=[plan.spec(i).sharing for i in range(2)])
    own, more = costs.flops(0), costs.flops(1)
    assert own.rollout_flops == more.rollout_flops
    # 4 prompts x (4 own + 2 peer) rows against 4 x 4: the update scales with its rows
    assert more.update_flops == pytest.approx(own.update_flops * (4 * 4 + 4 * 2) / (4 * 4))
    # resolved from the config (no plan at hand) it is the same price
    assert CostModel(cfg, [1000, 1000]).flops(1).update_flops == more.update_flops
    # the placement step's planner prices the plan's own objects (run_placement passes them)
    from mutualrl.allocation.adaptive import AdaptivePlan

    mwra = AdaptivePlan(cfg, Resources(2.0), params=[1000, 1000], verbose=False,
                        settings=[plan.spec(i).sharing for i in range(2)])
    assert all(mwra.costs.settings[i] is plan.spec(i).sharing for i in range(2))
