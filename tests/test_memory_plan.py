"""MWRA prices memory: each worker's bytes, the micro-batch budget that fits what the plan gives it,
a plan that cannot fit refused before anything runs (exit 2, naming the policy and the levers)."""

from __future__ import annotations

import json

import pytest
import yaml

from mutualrl.allocation import memory, memory_plan
from mutualrl.cli import main
from mutualrl.config import GRPOOptions
from mutualrl.rollout.policy import Policy


def _shape(**kw) -> memory.ModelShape:
    base = {"params": 135_000_000, "trainable": 135_000_000, "layers": 30, "hidden": 576, "intermediate": 1536,
            "heads": 9, "kv_heads": 3, "head_dim": 64, "vocab": 49152}
    return memory.ModelShape(**(base | kw))


def test_the_price_counts_each_part_and_the_budget_fits_the_allowance():
    """Weights, gradients and two AdamW moments per optimizer phase in fp32; a reference only with
    ``beta > 0`` and no LoRA; LoRA trains (and stores moments for) the adapter alone; the auto budget is
    the largest multiple of 1024 tokens whose peak fits, and the peak grows with the budget only."""
    p1 = memory.price(_shape(), phases=1)
    p2 = memory.price(_shape(), phases=2, beta=0.1)
    assert p1.weights == p1.gradients == 135_000_000 * 4
    assert p1.optimizer == 2 * 135_000_000 * 4 and p2.optimizer == 2 * p1.optimizer
    assert p1.reference == 0 and p2.reference == p1.weights
    lora = memory.price(_shape(trainable=1_000_000), beta=0.1, lora=True)
    assert lora.reference == 0 and lora.gradients == 4_000_000
    allowance = p1.resident + 3 * 2**30
    budget = p1.largest_budget(allowance)
    assert budget is not None and budget % memory.BUDGET_QUANTUM == 0
    assert p1.peak(budget) <= allowance
    if budget < p1.max_budget:
        assert allowance < p1.peak(budget + memory.BUDGET_QUANTUM)
    assert p1.largest_budget(p1.resident // 2) is None
    assert p1.peak(2048) > p1.peak(1024)
    gpu = memory.price(_shape(), gpu=True)
    assert gpu.activation_cap is None and p1.activation_cap is not None  # CPU cores: a micro-batch's bytes capped
    # auto budgets snap to whole prompt groups once one fits
    assert p1.largest_budget(p1.resident + 8 * 2**30, group_tokens=2112) % 2112 == 0


def test_the_activation_probe_counts_what_autograd_keeps(tiny_models):
    """The probe's bytes per token are what the update's own first micro-batch reports (both count the
    tensors autograd saves), and grow with the model's width: a measurement, not a constant."""
    pol = Policy("p", str(tiny_models["tiny-gpt2"]), GRPOOptions(dtype="float32", micro_batch_tokens=None))
    act = memory.measure_activation_bytes(pol, 6, 12)
    assert act > 0
    assert all(p.grad is None for p in pol.model.parameters())  # no gradient left behind
    prompt, comp = list(range(3, 9)), [list(range(10, 22))] * 4
    with memory.SavedBytes(pol.model) as saved:
        pol.logprobs([prompt] * 4, comp)
    per_token = saved.total / (6 + 4 * 12)
    assert 0.5 * act < per_token < 2.0 * act


def _config(tmp_path, model: str, **grpo) -> str:
    cfg = {"policies": [{"name": "big", "model": model}], "task": {"preset": "zoo"},
           "grpo": {"max_completion_length": 256, **grpo}, "prompts_per_step": 8}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_plan_that_cannot_fit_exits_2_naming_the_policy_bytes_and_levers(tmp_path, tiny_models, capsys):
    """A 7B policy trained in full on one 24 GB GPU (its fp32 weights alone are 28 GB), and a fixed
    micro-batch budget far beyond this machine's RAM: both refused before anything runs."""
    assert main(["plan", _config(tmp_path, "Qwen/Qwen2.5-7B-Instruct"), "--resources", "cpus=8,gpus=1x24"]) == 2
    err = capsys.readouterr().err
    assert "'big' (policies[0])" in err and "GiB" in err and "resident" in err and "peft" in err and "fsdp" in err
    path = _config(tmp_path, str(tiny_models["tiny-gpt2"]), micro_batch_tokens=10**9)
    assert main(["plan", path]) == 2
    assert "policies[0].grpo.micro_batch_tokens" in capsys.readouterr().err
    with pytest.raises(memory.MemoryPlanError, match="big"):  # and a run is refused as the plan is
        from mutualrl.run.trainer import MutualTrainer

        MutualTrainer(path, tmp_path / "run", progress=False).train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_plan_prints_each_policys_peak_and_gives_the_worker_its_budget(tmp_path, tiny_models, capsys):
    """``mutualrl plan`` prints every policy's predicted peak and budget (JSON too), and a worker built
    from the plan trains with the budget the plan resolved for ``auto``."""
    from mutualrl.run.worker import PolicyWorker

    path = _config(tmp_path, str(tiny_models["tiny-gpt2"]))
    assert main(["plan", path]) == 0
    out = capsys.readouterr().out
    assert "MWRA memory" in out and "predicted_peak" in out and "big" in out
    assert main(["plan", path, "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"][0]
    assert mem["micro_batch_tokens"] >= 256 and mem["predicted_peak"] <= mem["allowance"]
    import dataclasses

    from mutualrl.allocation.placement import place_in_process
    from mutualrl.config.resolve import resolve

    placed = place_in_process(resolve(path, check_paths=False))
    assert placed.workers[0].micro_batch_tokens == mem["micro_batch_tokens"]
    assert placed.workers[0].predicted_resident_bytes == mem["price"]["resident"] < mem["predicted_peak"]
    placed = dataclasses.replace(placed, workers=(dataclasses.replace(placed.workers[0], micro_batch_tokens=333),))
    w = PolicyWorker(placed, 0)  # the worker takes the budget its spec carries, not one of its own
    try:
        assert w.policy.micro_batch_tokens == 333
    finally:
        w.close()


def test_cpu_allowances_share_the_pool_by_how_updates_overlap():
    total = 100 * 2**30
    seq = memory.cpu_allowances([10 * 2**30, 20 * 2**30], concurrent=False, total=total)
    par = memory.cpu_allowances([10 * 2**30, 20 * 2**30], concurrent=True, total=total)
    pool = int(total * memory.CPU_HEADROOM) - 30 * 2**30
    assert seq == [10 * 2**30 + pool, 20 * 2**30 + pool]
    assert par == [10 * 2**30 + pool // 2, 20 * 2**30 + pool // 2]


def test_shapes_come_from_configs_without_weights(tiny_models):
    shape = memory_plan.model_shape(str(tiny_models["tiny-llama"]))
    pol = Policy("p", str(tiny_models["tiny-llama"]), GRPOOptions(dtype="float32"))
    assert shape == memory.ModelShape.of_model(pol.model)
    guess = memory_plan.model_shape("Qwen/Qwen2.5-7B-Instruct")
    assert guess is not None and 3_000 < guess.hidden < 5_000 and guess.kv_heads < guess.heads


def test_a_resumed_auto_budget_is_the_runs_own_unless_it_no_longer_fits(tmp_path, tiny_models):
    """The budget ``auto`` resolved is saved with the policy's state: a resume on a machine that gives
    as much memory continues with the same micro-batches (an exact resume); one that gives less keeps
    the plan's smaller budget and says so."""
    from mutualrl.config.resolve import load_config
    from mutualrl.run.worker import PolicyWorker

    w = PolicyWorker(load_config(_config(tmp_path, str(tiny_models["tiny-gpt2"]))), 0)
    try:
        w.policy.micro_batch_tokens = 512
        w.save(tmp_path / "ck")
        w.policy.micro_batch_tokens = 2048  # a resume whose plan allows more: the run's own budget back
        w.load(tmp_path / "ck")
        assert w.policy.micro_batch_tokens == 512
        w.policy.micro_batch_tokens = 256  # one whose plan allows less: the plan's, with a warning
        with pytest.warns(RuntimeWarning, match="micro_batch_tokens 256"):
            w.load(tmp_path / "ck")
        assert w.policy.micro_batch_tokens == 256
    finally:
        w.close()
