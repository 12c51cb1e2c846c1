"""Memory and speed of one full update at a user's size: mutualrl's micro-batched update beside TRL's
``GRPOTrainer`` with gradient accumulation, and the MWRA plan's predicted peak beside the measured one.

Each case is one fresh process (so its peak resident set is its own) that loads a real model in
fp32, samples 8 short completions (the sampler's packed weights exist, as in a worker), then takes
one full update on a batch of ``rows`` rows of 64 prompt + 256 completion tokens (random tokens;
groups of 8 rows share a prompt):

* ``mutualrl``: after a first update on one group (every phase's AdamW moments exist, as from a
  run's second step on), the policy's GRPO phase on every row, then ``imitate``'s own supervised phase (its own
  AdamW) on one peer row per prompt, ``micro_batch_tokens: auto`` (or ``--budget``). Its
  ``predicted_peak_mib`` is the plan's own price (:func:`mutualrl.allocation.memory.price`, what
  ``mutualrl plan`` prints) of what the case holds: the update's state with the sampler's packed
  copy and the KV cache of the 8 short rows it sampled (a plan prices a whole step's KV cache;
  sampling and updating take turns, and the update is what this case measures), activation bytes
  per token measured by the calibration probe.
* ``trl``: ``GRPOTrainer``'s own loss (``compute_loss``) on micro-batches of
  ``per_device_train_batch_size`` rows with their gradients accumulated, then its optimizer step:
  TRL's update path without its generation. The batch size is the largest of ``--trl-batch`` that
  ran without the kernel's OOM killer (tried largest first; a killed try is recorded).

``s_per_token`` is the update's wall time over its trained completion tokens. The two systems
alternate case by case. Targets (the real-size issue): the 256-row peak at most 1.25x the 16-row
peak, seconds per token at 256 rows at most 1.1x the one-forward update's at 16 rows
(``micro_batch_tokens: null``, today's update; ``--no-baseline`` leaves it out), the prediction within 20 %, and mutualrl's peak and
time per token at most TRL's.

    python benchmarks/memory.py                    # SmolLM2 and Gemma-3, 16/64/256 rows, with TRL
    python benchmarks/memory.py --models smollm2 --rows 16,64 --no-trl
    python benchmarks/memory.py --quick            # SmolLM2, 16 and 32 rows of 64 + 64 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, git_rev, machine, write_result

SCRIPT = Path(__file__).resolve()
G = 8
PROMPT, COMPLETION = 64, 256


def _model_dir(name: str) -> str:
    from mutualrl.realmodels.prepare import prepare

    return str(prepare(name, progress=False))


def _rows(vocab: int, rows: int, prompt: int, completion: int, seed: int = 0) -> tuple[list, list]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt,), generator=gen).tolist() for _ in range(max(1, rows // G))]
    own = []
    for p in prompts:
        for _ in range(G):
            ids = torch.randint(3, vocab, (completion,), generator=gen).tolist()
            own.append((p, ids, float(torch.randn((), generator=gen)), (-torch.rand(completion, generator=gen)).tolist()))
    peer = [(p, torch.randint(3, vocab, (completion,), generator=gen).tolist()) for p in prompts]
    return own, peer


def child_mutualrl(s: dict[str, Any]) -> dict[str, Any]:
    import torch

    from mutualrl.algorithms.registry import OWN
    from mutualrl.algorithms.sharing import TrainBatch, TrainRow, parse_strategy
    from mutualrl.algorithms.update import train_on_batch
    from mutualrl.allocation import memory
    from mutualrl.config import GRPOOptions
    from mutualrl.rollout.policy import Policy

    torch.set_num_threads(s["threads"])
    opts = GRPOOptions(num_generations=G, max_completion_length=s["completion"], dtype="float32",
                       learning_rate=1e-6, micro_batch_tokens=s["budget"])
    pol = Policy("p", _model_dir(s["model"]), opts, seed=0)
    settings = {"imitate": {"learning_rate": 1e-6}}
    strategy = parse_strategy("imitate")
    for phase, lr in strategy.optimizer_phases(settings).items():
        pol.add_optimizer(phase, lr)
    kinds = strategy.kinds(settings)
    vocab = min(len(pol.tokenizer), pol.model.config.vocab_size)
    pol.generate_ids([[5, 6, 7]] * 8, max_new_tokens=8)  # the sampler as a worker has it: packed, warm
    t0 = time.perf_counter()
    act = memory.measure_activation_bytes(pol, s["prompt"], s["completion"])
    calib_s = time.perf_counter() - t0
    budget = pol.fit_micro_batches(act_bytes_per_token=act) if s["budget"] == "auto" else pol.micro_batch_tokens
    price = memory.price(memory.ModelShape.of_model(pol.model), phases=len(pol.optimizers), sample_rows=8,
                         sample_tokens=11, act_bytes_per_token=act, logits_budget=pol.logits_budget)
    own, peer = _rows(vocab, s["rows"], s["prompt"], s["completion"])
    rows = [TrainRow(p, c, a, lp, OWN) for p, c, a, lp in own] + [TrainRow(p, c, 0.0, None, "imitate", None, 1.0)
                                                                  for p, c in peer]
    batch = TrainBatch(rows, n_prompts=len(peer), kinds=kinds)
    # a run's update after its first: every phase's AdamW moments exist (a first update allocates them
    # into the pages its activations freed, and would read low)
    train_on_batch(pol, TrainBatch([r for r in rows if r.prompt_ids == rows[0].prompt_ids], n_prompts=1, kinds=kinds))
    memory.reset_process_peak()
    t0 = time.perf_counter()
    stats = train_on_batch(pol, batch)
    update_s = time.perf_counter() - t0
    tokens = sum(len(r.completion_ids) for r in rows)
    whole = s["prompt"] * len(peer) + sum(len(r.completion_ids) for r in rows if r.kind == OWN)
    return {"peak_mib": memory.process_peak_bytes() / 2**20, "update_s": update_s, "trained_tokens": tokens,
            "s_per_token": update_s / tokens, "micro_batch_tokens": budget,
            "micro_batches": stats.get("micro_batches"), "imitate_micro_batches": stats.get("imitate_micro_batches"),
            "predicted_peak_mib": price.peak(min(budget, whole) if budget else whole) / 2**20,
            "act_bytes_per_token": act, "calibration_s": calib_s, "price": price.to_dict(),
            "loss": stats.get("loss")}


def child_trl(s: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from mutualrl.allocation import memory

    torch.set_num_threads(s["threads"])
    path = _model_dir(s["model"])
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    b = s["trl_batch"]
    args = GRPOConfig(output_dir=s["out"], per_device_train_batch_size=b, gradient_accumulation_steps=max(1, s["rows"] // b),
                      num_generations=G, max_completion_length=s["completion"], learning_rate=1e-6, beta=0.0,
                      loss_type="dr_grpo", bf16=False, use_cpu=True, report_to=[], logging_steps=1,
                      generation_batch_size=s["rows"], save_strategy="no")
    data = Dataset.from_dict({"prompt": ["x"] * 16})
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=data, processing_class=tok)
    trainer.create_optimizer()
    for p in model.parameters():  # AdamW's moments as from the second step on (mutualrl's case has them too)
        trainer.optimizer.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                          step=torch.tensor(0.0))
    vocab = min(len(tok), model.config.vocab_size)
    own, _ = _rows(vocab, s["rows"], s["prompt"], s["completion"])
    model.train()
    trainer.current_gradient_accumulation_steps = max(1, len(own) // b)  # what Trainer's loop sets each step
    memory.reset_process_peak()
    t0 = time.perf_counter()
    for start in range(0, len(own), b):
        part = own[start:start + b]
        n = len(part)
        inputs = {"prompt_ids": torch.tensor([p for p, *_ in part]), "prompt_mask": torch.ones(n, s["prompt"], dtype=torch.long),
                  "completion_ids": torch.tensor([c for _, c, *_ in part]),
                  "completion_mask": torch.ones(n, s["completion"], dtype=torch.long),
                  "advantages": torch.tensor([a for _, _, a, _ in part]), "old_per_token_logps": None,
                  "num_items_in_batch": torch.tensor(len(own) * s["completion"])}
        loss = trainer.compute_loss(model, inputs)  # dr_grpo: normalised over the accumulation by TRL itself
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    update_s = time.perf_counter() - t0
    tokens = len(own) * s["completion"]
    return {"peak_mib": memory.process_peak_bytes() / 2**20, "update_s": update_s, "trained_tokens": tokens,
            "s_per_token": update_s / tokens, "per_device_train_batch_size": b,
            "gradient_accumulation_steps": max(1, s["rows"] // b)}


def run_child(s: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One case in a fresh process: its result, or why it has none (killed by the OOM killer, ...)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(SCRIPT), "--child", json.dumps(s)], capture_output=True, text=True, check=False,
                           timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        why = "killed (SIGKILL: the kernel's OOM killer)" if p.returncode in (-9, 137) else f"exit {p.returncode}"
        return {"error": why, "stderr_tail": p.stderr[-800:], "wall_s": wall}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3", help="comma list of real models (smollm2, gemma3)")
    ap.add_argument("--rows", default="16,64,256", help="comma list of rows per update")
    ap.add_argument("--budget", default="auto", help="micro_batch_tokens for mutualrl (auto, or a number)")
    ap.add_argument("--trl-batch", default="32,16,8", help="TRL per_device_train_batch_size, tried largest first")
    ap.add_argument("--no-trl", action="store_true", help="mutualrl only")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="leave out the one-forward update (micro_batch_tokens: null) at the smallest row count, "
                    "the speed target's reference")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per case")
    ap.add_argument("--quick", action="store_true", help="SmolLM2, 16 and 32 rows of 64 + 64 tokens, no TRL")
    ap.add_argument("--out", default=None, help="result name (default memory / memory_quick)")
    ap.add_argument("--append", action="store_true",
                    help="keep the result file's cases of other models/rows (several sittings, one JSON)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        s = json.loads(args.child)
        print(json.dumps(child_trl(s) if s["system"] == "trl" else child_mutualrl(s)))
        return 0
    completion = 64 if args.quick else COMPLETION
    models = ["smollm2"] if args.quick else args.models.split(",")
    rows_list = [16, 32] if args.quick else [int(r) for r in args.rows.split(",")]
    budget: Any = args.budget if args.budget == "auto" else int(args.budget)
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    cases: list[dict[str, Any]] = []
    import tempfile

    for model in models:
        _model_dir(model)
        trl_batches = [int(b) for b in args.trl_batch.split(",")]
        plans: list[dict[str, Any]] = []
        if args.baseline:
            plans.append({"system": "mutualrl", "rows": rows_list[0], "budget": None, "variant": "one_forward"})
        for rows in rows_list:
            plans.append({"system": "mutualrl", "rows": rows, "budget": budget, "variant": "micro_batched"})
            if not (args.no_trl or args.quick):
                plans.append({"system": "trl", "rows": rows})
        for plan in plans:
            s = {"model": model, "prompt": PROMPT, "completion": completion, "threads": args.threads, **plan}
            if plan["system"] == "trl":
                tries = []
                for b in [b for b in trl_batches if b <= plan["rows"]]:
                    with tempfile.TemporaryDirectory() as out:
                        res = run_child({**s, "trl_batch": b, "out": out}, args.timeout)
                    if "error" not in res:
                        break
                    tries.append({"per_device_train_batch_size": b, **res})
                res["failed_tries"] = tries
            else:
                res = run_child(s, args.timeout)
            case = {"system": plan["system"], "model": model, "rows": plan["rows"], "tokens_per_row": PROMPT + completion,
                    "variant": plan.get("variant"), **res}
            cases.append(case)
            print(f"{model:8s} {plan['system']:8s} {plan.get('variant') or '':13s} rows={plan['rows']:4d} "
                  f"peak={res.get('peak_mib', float('nan')):8.0f} MiB  pred={res.get('predicted_peak_mib', float('nan')):8.0f}"
                  f"  s/token={res.get('s_per_token', float('nan')):.5f}  {res.get('error', '')}", flush=True)
    name = args.out or ("memory_quick" if args.quick else "memory")
    runs = [{"git_rev": git_rev(), "models": models, "rows": rows_list, "load_avg": [load0, os.getloadavg()[0]],
             "wall_s": time.perf_counter() - t_start}]
    if args.append and (RESULTS / f"{name}.json").is_file():  # a later sitting's models join the earlier ones
        old = json.loads((RESULTS / f"{name}.json").read_text())
        key = lambda c: (c["system"], c["model"], c["rows"], c.get("variant"))
        new_keys = {key(c) for c in cases}
        cases = [c for c in old["cases"] if key(c) not in new_keys] + cases
        runs = old.get("runs", []) + runs
    result = {"cases": cases, "checks": checks(cases), "runs": runs, "quick": args.quick, "wall_s": time.perf_counter() - t_start,
              "git_rev": git_rev(), "machine": {**machine(), "load_avg": [load0, os.getloadavg()[0]]},
              "settings": {"prompt_tokens": PROMPT, "completion_tokens": completion, "group": G,
                           "micro_batch_tokens": args.budget, "dtype": "float32"}}
    path = write_result(name, result)
    print(json.dumps(result["checks"], indent=1))
    print(f"wrote {path}")
    return 0


def checks(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures from the cases, per model (None where a case is missing)."""
    out: dict[str, Any] = {}
    for model in sorted({c["model"] for c in cases}):
        mine = {c["rows"]: c for c in cases if c["model"] == model and c["system"] == "mutualrl"
                and c.get("variant") == "micro_batched" and "error" not in c}
        base = next((c for c in cases if c["model"] == model and c.get("variant") == "one_forward" and "error" not in c), None)
        trl = {c["rows"]: c for c in cases if c["model"] == model and c["system"] == "trl" and "error" not in c}
        lo, hi = (min(mine), max(mine)) if mine else (None, None)
        m: dict[str, Any] = {}
        if lo is not None and hi != lo:
            m["peak_ratio_largest_to_smallest"] = mine[hi]["peak_mib"] / mine[lo]["peak_mib"]
            m["peak_target_met"] = m["peak_ratio_largest_to_smallest"] <= 1.25
        if base is not None and hi is not None:
            m["s_per_token_largest_vs_one_forward_smallest"] = mine[hi]["s_per_token"] / base["s_per_token"]
            m["speed_target_met"] = m["s_per_token_largest_vs_one_forward_smallest"] <= 1.1
        m["prediction_error"] = {r: c["predicted_peak_mib"] / c["peak_mib"] - 1 for r, c in mine.items()}
        m["prediction_target_met"] = all(abs(v) <= 0.2 for v in m["prediction_error"].values()) if mine else None
        m["vs_trl"] = {r: {"peak_ratio": mine[r]["peak_mib"] / trl[r]["peak_mib"],
                           "s_per_token_ratio": mine[r]["s_per_token"] / trl[r]["s_per_token"]}
                       for r in mine if r in trl}
        out[model] = m
    return out


if __name__ == "__main__":
    sys.exit(main())
