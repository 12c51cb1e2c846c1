"""The real-size smoke of ``benchmarks/gpu_check.py``: one GPU, the Qwen2.5-0.5B shape, a user's batch.

Each variant is a fresh process under its own time limit (a crash or an out-of-memory in one leaves
the others their say): it samples ``rows`` completions of up to ``completion`` tokens after prompts
of ``prompt`` tokens with the policy's own sampler, then takes one full update on them (the GRPO
phase, and for the sharing variant ``imitate``'s own phase) with ``micro_batch_tokens: auto``.
Recorded: the loss (finite?), the sampler/trainer log-prob mismatch, peak CUDA memory, the plan's
predicted peak, micro-batches, seconds and tokens. The ``base`` variant then saves the policy's
state, and a process that sees no GPU (``CUDA_VISIBLE_DEVICES=``) loads it.

    python benchmarks/_real_size_smoke.py MODEL_DIR OUT_DIR [--dry-run]
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "base": {"rows": 256},
    "checkpointing": {"rows": 64, "gradient_checkpointing": True},
    "lora": {"rows": 64, "peft": True},
    "lora_checkpointing": {"rows": 64, "peft": True, "gradient_checkpointing": True},
    "beta": {"rows": 64, "beta": 0.05},
    "iterations2_imitate": {"rows": 64, "num_iterations": 2, "imitate": True},
}
"""Variant -> its settings (rows per update; the rest as GRPO/peft options)."""
PROMPT, COMPLETION, G = 128, 512, 8


def _variant(model: str, name: str, out: Path, dry: bool) -> dict[str, Any]:
    """One variant in this process (the child's side)."""
    import torch

    from mutualrl.algorithms.registry import OWN
    from mutualrl.algorithms.sharing import TrainBatch, TrainRow, parse_strategy
    from mutualrl.algorithms.update import train_on_batch
    from mutualrl.allocation import memory
    from mutualrl.config import GRPOOptions, PeftConfig
    from mutualrl.run.checkpoint import save_policy_state

    v = VARIANTS[name]
    rows = 16 if dry else v["rows"]
    prompt, completion = (8, 16) if dry else (PROMPT, COMPLETION)
    device = "cpu" if dry else "cuda"
    opts = GRPOOptions(num_generations=G, max_completion_length=completion, learning_rate=1e-6,
                       dtype="float32" if dry else "auto", beta=v.get("beta", 0.0),
                       num_iterations=v.get("num_iterations", 1),
                       gradient_checkpointing=v.get("gradient_checkpointing", False), micro_batch_tokens="auto",
                       dynamic_sampling="off")
    from mutualrl.rollout.policy import Policy

    pol = Policy("p", model, opts, device=device, seed=0,
                 peft=PeftConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) if v.get("peft") else None)
    settings = {"imitate": {"learning_rate": 1e-6}} if v.get("imitate") else {}
    strategy = parse_strategy("imitate" if v.get("imitate") else "independent")
    for phase, lr in strategy.optimizer_phases(settings).items():
        pol.add_optimizer(phase, lr)
    vocab = min(len(pol.tokenizer), pol.model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt,), generator=gen).tolist() for _ in range(rows // G)]
    t0 = time.perf_counter()
    g = pol.engine.generate(prompts, G, pol.sampling_params())
    sample_s = time.perf_counter() - t0
    batch_rows = [TrainRow(prompts[i // G], ids, float(torch.randn((), generator=gen)), lp, OWN)
                  for i, (ids, lp) in enumerate(zip(g.ids, g.logprobs, strict=True)) if ids]
    if v.get("imitate"):
        batch_rows += [TrainRow(p, torch.randint(3, vocab, (completion,), generator=gen).tolist(), 0.0, None,
                                "imitate", None, 1.0) for p in prompts]
    if pol.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(pol.device)
    t0 = time.perf_counter()
    stats = train_on_batch(pol, TrainBatch(batch_rows, n_prompts=len(prompts), kinds=strategy.kinds(settings)))
    if pol.device.type == "cuda":
        torch.cuda.synchronize(pol.device)
    update_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(pol.device) / 2**20 if pol.device.type == "cuda" else \
        memory.process_peak_bytes() / 2**20
    price = memory.price(memory.ModelShape.of_model(pol.model), phases=len(pol.optimizers), beta=opts.beta,
                         lora=pol.lora, checkpointing=opts.gradient_checkpointing, gpu=pol.device.type == "cuda",
                         sample_rows=rows, sample_tokens=prompt + completion, bf16=pol.compute_dtype == "bfloat16",
                         act_bytes_per_token=stats.get("act_bytes_per_token"))
    res = {"rows": len(batch_rows), "sampled_tokens": sum(len(i) for i in g.ids), "sample_s": sample_s,
           "trained_tokens": sum(len(r.completion_ids) for r in batch_rows), "update_s": update_s,
           "loss": stats.get("loss"), "finite": all(math.isfinite(float(x)) for x in stats.values()),
           "logprob_mismatch_max": stats.get("logprob_mismatch_max"),
           "logprob_mismatch_mean": stats.get("logprob_mismatch_mean"), "peak_mib": peak,
           "micro_batch_tokens": pol.micro_batch_tokens, "micro_batches": stats.get("micro_batches"),
           "predicted_peak_mib": (price.peak(pol.micro_batch_tokens or 0) - price.process) / 2**20,
           "act_bytes_per_token": stats.get("act_bytes_per_token"), "dtype": pol.compute_dtype}
    if name == "base":
        save_policy_state(out / "ckpt", pol, {"step": 1})
    return res


def _load_without_gpu(model: str, out: Path) -> dict[str, Any]:
    """The child's side of the load: a fresh CPU policy reads the GPU run's state."""
    from mutualrl.config import GRPOOptions
    from mutualrl.rollout.policy import Policy
    from mutualrl.run.checkpoint import load_policy_state

    pol = Policy("p", model, GRPOOptions(num_generations=G, dtype="float32"), device="cpu")
    extra = load_policy_state(out / "ckpt", pol)
    return {"loaded": True, "step": extra.get("step")}


def run(model: Path, out: Path, dry: bool, timeout_s: float = 90.0) -> dict[str, Any]:
    """Every variant in its own process, then the load with the GPU hidden: the results by name."""
    results: dict[str, Any] = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    calls = [(name, []) for name in VARIANTS] + [("load_without_gpu", ["--load"])]
    for name, extra in calls:
        cmd = [sys.executable, __file__, str(model), str(out), "--variant", name, *extra, *(["--dry-run"] if dry else [])]
        child_env = dict(env, CUDA_VISIBLE_DEVICES="") if extra else env
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env, check=False)
            if p.returncode == 0:
                results[name] = json.loads(p.stdout.strip().splitlines()[-1])
            else:
                results[name] = {"failed": f"exit {p.returncode}", "stderr_tail": p.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            results[name] = {"failed": f"timed out after {timeout_s:.0f} s"}
        results[name]["wall_s"] = time.perf_counter() - t0
        print(f"real-size {name:20s} " + ", ".join(f"{k}={results[name].get(k)}" for k in (
            "failed", "loss", "peak_mib", "predicted_peak_mib", "logprob_mismatch_max", "micro_batches", "loaded")
            if k in results[name]), flush=True)
    return results


def main() -> None:
    args = sys.argv[1:]
    dry = "--dry-run" in args
    model, out = args[0], Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    if "--load" in args:
        print(json.dumps(_load_without_gpu(model, out)))
    else:
        print(json.dumps(_variant(model, args[args.index("--variant") + 1], out, dry)))


if __name__ == "__main__":
    main()
