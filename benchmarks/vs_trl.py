"""mutualrl single-policy GRPO vs Hugging Face TRL's GRPOTrainer: same model, data and settings.

    python benchmarks/vs_trl.py [--quick] [--cases zoo,smollm2,smollm2_bf16] [--repeats 3]
                                [--threads 2] [--device cpu|cuda]

For each case (model x dtype) the two systems run alternately (mutualrl, TRL, mutualrl, TRL, ...),
each run in a fresh Python process, so peak RSS figures are comparable and one system's
allocations never warm the other's. Both get the same prompts per step (reasoning-gym 2-digit
addition/subtraction, ``"{question} Answer: "``), the same verifier as the reward, the same group
size, batch, completion length, temperature, clip range, loss type (``dr_grpo``), ``beta = 0``,
``num_iterations = 1``, learning rate, gradient clipping, dtype and torch threads; TRL's gradient
checkpointing is off (mutualrl does not checkpoint). Both are made to generate exactly
``max_completion_length`` tokens per completion (TRL: ``min_new_tokens``; mutualrl: no stop
token), so they do identical model work and tokens/s compare directly.

Per system and case: completion tokens per second of step wall time (the headline,
``*_tokens_per_s``), generated tokens/s (sampling time only), trained tokens/s (step time minus
the rollout phase), per-step wall time, peak RSS, training MFU (model FLOPs of the update /
update time / this machine's measured matmul peak for the dtype, measured in the same run) and the
ratio mutualrl / TRL. The first ``warmup`` steps of every run are not counted.

``--device cuda`` runs both on the GPU (peak memory is then ``torch.cuda.max_memory_allocated``)
and writes ``vs_trl_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _perf
from _common import git_rev, machine, write_result, write_result_to

SCRIPT = Path(__file__).resolve()

CASES: dict[str, tuple[str, str]] = {
    "zoo": ("zoo:gpt2-add", "float32"),
    "zoo_bf16": ("zoo:gpt2-add", "bfloat16"),
    "smollm2": ("smollm2", "float32"),
    "smollm2_bf16": ("smollm2", "bfloat16"),
}
"""Case name -> (model, dtype)."""

TEST_SIZE = 100
TRAIN_SIZE = 20000


# ----------------------------------------------------------------------------- shared settings
def settings(args: argparse.Namespace, case: str) -> dict[str, Any]:
    """The settings both systems get for ``case``."""
    model, dtype = CASES[case]
    small = model.startswith("zoo:")
    # a zoo step takes ~0.15 s: 40 steps per run keep one scheduler hiccup from moving a pair's ratio
    # a real model's first two steps are transients for both systems (the first optimizer step
    # allocates its state; the second sampling call and update still allocate): a full run times
    # steps 3-5 of 5, the quick one step 2-3 of 3
    steps = args.steps or ((6 if args.quick else 40) if small else (3 if args.quick else 5))
    return {"model": model, "dtype": dtype, "threads": args.threads, "device": args.device,
            "prompts_per_step": args.prompts, "num_generations": args.generations,
            "max_completion_length": args.completion_len, "temperature": 1.0, "learning_rate": 1e-5,
            "beta": 0.0, "epsilon": 0.2, "num_iterations": 1, "loss_type": "dr_grpo",
            "scale_rewards": "group", "max_grad_norm": 1.0, "steps": steps,
            "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 2), "seed": 0,
            "trl_process_settings": args.trl_process_settings}


def step_problems(s: dict[str, Any]) -> list[list[Any]]:
    """The problems of every step (mutualrl's deterministic per-step sampling, reused for TRL)."""
    from mutualrl import zoo

    task = zoo.default_task(seed=0, test_size=TEST_SIZE, train_size=TRAIN_SIZE)
    return [task.sample_train(step, s["prompts_per_step"]) for step in range(s["steps"])], task


def _model_shape(model: Any) -> tuple[int, int]:
    c = model.config
    n_layer = getattr(c, "num_hidden_layers", None) or c.n_layer
    d = getattr(c, "hidden_size", None) or c.n_embd
    return int(n_layer), int(d)


def _kv_dim(model: Any) -> int:
    """Width of one layer's keys (= values) per token: KV heads x head size."""
    c = model.config
    d = _model_shape(model)[1]
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return int(kv_heads * (getattr(c, "head_dim", None) or d // heads))


def _peak_memory_mb(device: str) -> float | None:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2 ** 20
    return None


def _summarise_steps(s: dict[str, Any], model: Any, rows: list[dict[str, float]]) -> dict[str, Any]:
    """Per-step records -> the child's figures (warmup steps dropped)."""
    params = _perf.param_breakdown(model)
    n_layer, d = _model_shape(model)
    keep = rows[s["warmup"]:]
    out: dict[str, Any] = {"steps_measured": len(keep), "params": params}
    if not keep:
        return out
    tot = {k: sum(r[k] for r in keep) for k in keep[0]}
    train_fl = sum(_perf.train_flops(params, n_layer, d, r["seq_tokens"], r["completion_tokens"], r["rows"],
                                     r["seq_len"]) for r in keep)
    exec_fl = sum(_perf.train_flops(params, n_layer, d, r.get("exec_seq_tokens", r["seq_tokens"]),
                                    r["completion_tokens"], r["rows"], r["seq_len"]) for r in keep)
    gen_fl = sum(_perf.gen_flops(params, n_layer, d, r["prompt_tokens"], r["completion_tokens"], r["seq_len"])
                 for r in keep)
    # the physical limits of this work (the parent divides by the measured bandwidth and peak)
    prefill_fl = sum(_perf.gen_flops(params, n_layer, d, r["prompt_tokens"], 0, r["seq_len"]) for r in keep)
    elem = 2 if s["dtype"] == "bfloat16" else 4
    kv = _kv_dim(model)
    t_new = s["max_completion_length"]
    dec_bytes = sum(_perf.decode_bytes((params["body"] + params["head"]) * elem, n_layer, kv, elem, int(r["rows"]),
                                       int(r["seq_len"]) - t_new, t_new) for r in keep)
    out.update({
        "step_s": [r["step_s"] for r in keep],
        "step_s_median": _perf.median([r["step_s"] for r in keep]),
        "tokens_per_s": tot["completion_tokens"] / tot["step_s"],
        "cpu_tokens_per_s": tot["completion_tokens"] / tot["cpu_s"],
        "cpu_s_per_step": tot["cpu_s"] / len(keep),
        "generated_tokens_per_s": tot["completion_tokens"] / tot["generate_s"],
        "trained_tokens_per_s": tot["completion_tokens"] / tot["train_s"],
        "generate_s_per_step": tot["generate_s"] / len(keep),
        "rollout_s_per_step": tot["rollout_s"] / len(keep),
        "train_s_per_step": tot["train_s"] / len(keep),
        "completion_tokens_per_step": tot["completion_tokens"] / len(keep),
        "prompt_tokens_per_step": tot["prompt_tokens"] / len(keep),
        "train_flops_per_s": train_fl / tot["train_s"],
        "train_exec_flops_per_s": exec_fl / tot["train_s"],
        "gen_flops_per_s": gen_fl / tot["generate_s"],
        "bound_inputs": {"prefill_flops_per_step": prefill_fl / len(keep),
                         "decode_flops_per_step": (gen_fl - prefill_fl) / len(keep),
                         "decode_bytes_per_step": dec_bytes / len(keep), "train_flops_per_step": train_fl / len(keep),
                         "completion_tokens_per_step": tot["completion_tokens"] / len(keep)},
    })
    return out


# ----------------------------------------------------------------------------- mutualrl child
def child_mutualrl(s: dict[str, Any]) -> dict[str, Any]:
    """One mutualrl run: MutualTrainer with one policy, ``independent``, in-memory exchange."""
    import torch

    torch.set_num_threads(s["threads"])
    from mutualrl.allocation import SequentialScheduler
    from mutualrl.run.trainer import MutualTrainer

    mdir, _ = _perf.model_dir(s["model"])
    device = s["device"]

    class Sched(SequentialScheduler):
        """In-process scheduler that makes the policy generate full-length completions."""

        kept: tuple[Any, ...] = ()

        def start(self, cfg: Any, run_dir: Any) -> list[dict[str, Any]]:
            infos = super().start(cfg, run_dir)
            for w in self.workers:
                w.policy.engine.eos_ids = [int(w.policy.model.config.vocab_size) + 7]  # never sampled: full length
            Sched.kept = tuple(self.workers)
            return infos

    stamps: list[float] = []
    cpu: list[float] = []

    class Trainer(MutualTrainer):
        def evaluate(self, step: int) -> list[dict[str, Any]]:
            out = super().evaluate(step)
            if not stamps:
                stamps.append(time.perf_counter())
                cpu.append(time.process_time())
            return out

        def _log(self, rows: list[dict[str, Any]]) -> None:
            super()._log(rows)
            if rows and rows[0].get("event") != "eval":
                stamps.append(time.perf_counter())
                cpu.append(time.process_time())

    cfg = {
        "policies": [{"name": "p", "model": str(mdir)}],
        # the same reward as TRL's (the verifier's score) and every row trained, as TRL trains them
        "task": {"preset": "zoo", "test_size": TEST_SIZE, "train_size": TRAIN_SIZE, "reward": "score"},
        "grpo": {**{k: s[k] for k in ("num_generations", "learning_rate", "beta", "epsilon", "num_iterations",
                                      "loss_type", "scale_rewards", "max_completion_length", "temperature",
                                      "max_grad_norm", "dtype")}, "dynamic_sampling": "off"},
        "sharing": {"strategy": "independent"},
        "steps": s["steps"], "prompts_per_step": s["prompts_per_step"], "eval_every": 10 ** 6,
        "eval_size": 2, "eval_batch_size": 2, "checkpoint_every": 10 ** 6, "seed": s["seed"],
        "exchange": "memory://", "scheduler": "sequential", "threads": s["threads"], "device": device,
    }
    sched = Sched(s["threads"])
    tr = Trainer(cfg, None, scheduler=sched, progress=False)
    t_start = time.perf_counter()
    tr.train()
    worker = Sched.kept[0]
    steps = [r for r in tr.history if r.get("event") != "eval"]
    rows = []
    for i, r in enumerate(steps):
        step = int(r["step"])
        p_lens = [len(worker.policy.encode_prompt(p.question)) for p in worker.problems(step)]
        g = s["num_generations"]
        wall = stamps[i + 1] - stamps[i]
        rows.append({"step_s": wall, "cpu_s": cpu[i + 1] - cpu[i], "generate_s": r["generate_s"], "rollout_s": r["rollout_s"],
                     "train_s": wall - r["rollout_s"], "completion_tokens": r["gen_tokens"],
                     "prompt_tokens": sum(p_lens) * g, "rows": len(p_lens) * g,
                     "seq_tokens": sum(p_lens) * g + r["gen_tokens"],
                     "exec_seq_tokens": sum(p_lens) + r["gen_tokens"],  # each prompt once per group
                     "seq_len": max(p_lens) + s["max_completion_length"]})
    out = _summarise_steps(s, worker.policy.model, rows)
    out.update({"system": "mutualrl", "run_s": time.perf_counter() - t_start,
                "reward_mean": [r["reward_mean"] for r in steps],
                "cuda_peak_mb": _peak_memory_mb(device)})
    return out


# ----------------------------------------------------------------------------- TRL child
def child_trl(s: dict[str, Any]) -> dict[str, Any]:
    """One TRL run: ``GRPOTrainer`` on the same prompts, verifier and settings."""
    import torch

    torch.set_num_threads(s["threads"])
    if s.get("trl_process_settings"):  # what mutualrl's workers set for themselves (heap kept, denormals flushed)
        from mutualrl.denormals import flush_denormals
        from mutualrl.heap import retain_freed_memory

        retain_freed_memory()
        flush_denormals()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mutualrl.zoo import format_prompt

    mdir, _ = _perf.model_dir(s["model"])
    per_step, task = step_problems(s)
    by_id = {p.id: p for ps in per_step for p in ps}
    # one dataset row per prompt, in mutualrl's per-step order (shuffle off): the same prompts per step
    data = Dataset.from_list([{"prompt": format_prompt(p.question), "problem_id": p.id}
                              for ps in per_step for p in ps])

    def verifier_reward(prompts: list[str], completions: list[str], problem_id: list[str], **_: Any) -> list[float]:
        """The task's reasoning-gym verifier (the reward mutualrl uses)."""
        return [task.verify(by_id[i], c) for i, c in zip(problem_id, completions, strict=True)]

    tok = AutoTokenizer.from_pretrained(mdir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    c = s["max_completion_length"]
    bsz = s["prompts_per_step"] * s["num_generations"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs_trl_"), use_cpu=s["device"] == "cpu",
        per_device_train_batch_size=bsz, generation_batch_size=bsz, num_generations=s["num_generations"],
        max_completion_length=c, temperature=s["temperature"], top_p=1.0, top_k=0,
        learning_rate=s["learning_rate"], beta=s["beta"], epsilon=s["epsilon"],
        num_iterations=s["num_iterations"], loss_type=s["loss_type"], scale_rewards=s["scale_rewards"],
        max_grad_norm=s["max_grad_norm"], max_steps=s["steps"], bf16=s["dtype"] == "bfloat16",
        gradient_checkpointing=False, shuffle_dataset=False, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=s["seed"], generation_kwargs={"min_new_tokens": c},
        dataloader_num_workers=0, log_completions=False,
    )
    gen_s: list[float] = []
    roll_s: list[float] = []
    tokens: list[dict[str, float]] = []
    rewards: list[float] = []
    stamps: list[float] = []
    cpu: list[float] = []

    class Timed(GRPOTrainer):
        """GRPOTrainer with timers around its sampling and its generate-and-score phase."""

        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            gen_s.append(time.perf_counter() - t)
            return out

        def _generate_and_score_completions(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **k)
            roll_s.append(time.perf_counter() - t)
            pm, cm = out["prompt_mask"], out["completion_mask"]
            tokens.append({"prompt_tokens": float(pm.sum()), "completion_tokens": float(cm.sum()),
                           "rows": float(pm.shape[0]), "seq_len": float(pm.shape[1] + cm.shape[1])})
            return out

    class Stamp(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **k: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = Timed(model=model, reward_funcs=verifier_reward, args=args, train_dataset=data,
                    processing_class=tok, callbacks=[Stamp()])
    t_start = time.perf_counter()
    trainer.train()
    rows = []
    for i, tk in enumerate(tokens):
        wall = stamps[i + 1] - stamps[i]
        rows.append({"step_s": wall, "cpu_s": cpu[i + 1] - cpu[i], "generate_s": gen_s[i], "rollout_s": roll_s[i], "train_s": wall - roll_s[i],
                     "completion_tokens": tk["completion_tokens"], "prompt_tokens": tk["prompt_tokens"],
                     "rows": tk["rows"], "seq_tokens": tk["prompt_tokens"] + tk["completion_tokens"],
                     "seq_len": tk["seq_len"]})
    out = _summarise_steps(s, trainer.model, rows)
    out.update({"system": "trl", "run_s": time.perf_counter() - t_start, "reward_mean": rewards,
                "cuda_peak_mb": _peak_memory_mb(s["device"])})
    return out


# ----------------------------------------------------------------------------- parent
def run_case(case: str, s: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Alternate the two systems ``repeats`` times on one case; aggregate."""
    runs: dict[str, list[dict[str, Any]]] = {"mutualrl": [], "trl": []}
    for r in range(repeats):
        for system in ("mutualrl", "trl"):
            res = _perf.run_child(SCRIPT, dict(s, system=system))
            runs[system].append(res)
            if "error" in res:
                print(f"  {case} {system} #{r}: ERROR {res['error'][-800:]}", file=sys.stderr)
            else:
                print(f"  {case} {system} #{r}: {res['tokens_per_s']:.1f} tok/s, step "
                      f"{res['step_s_median']:.3f}s, peak {res['peak_rss_mb']:.0f} MB", file=sys.stderr)
    out: dict[str, Any] = {"model": s["model"], "dtype": s["dtype"], "settings": s}
    for system, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        out[f"{system}_errors"] = [x["error"][-500:] for x in rs if "error" in x]
        if not ok:
            continue

        def med(k: str, ok: list[dict[str, Any]] = ok) -> float:
            return _perf.median([x[k] for x in ok])

        out[f"{system}_tokens_per_s"] = med("tokens_per_s")
        out[f"{system}_cpu_tokens_per_s"] = med("cpu_tokens_per_s")
        out[f"{system}_cpu_s_per_step"] = med("cpu_s_per_step")
        out[f"{system}_generated_tokens_per_s"] = med("generated_tokens_per_s")
        out[f"{system}_trained_tokens_per_s"] = med("trained_tokens_per_s")
        out[f"{system}_step_s"] = med("step_s_median")
        out[f"{system}_generate_s_per_step"] = med("generate_s_per_step")
        out[f"{system}_train_s_per_step"] = med("train_s_per_step")
        out[f"{system}_completion_tokens_per_step"] = med("completion_tokens_per_step")
        out[f"{system}_prompt_tokens_per_step"] = med("prompt_tokens_per_step")
        peak = "cuda_peak_mb" if s["device"] == "cuda" else "peak_rss_mb"
        out[f"{system}_peak_mb"] = med(peak)
        out[f"{system}_train_flops_per_s"] = med("train_flops_per_s")
        out[f"{system}_gen_flops_per_s"] = med("gen_flops_per_s")
        out[f"{system}_train_exec_flops_per_s"] = med("train_exec_flops_per_s")
        out[f"{system}_per_repeat_tokens_per_s"] = [x["tokens_per_s"] for x in ok]
        out[f"{system}_reward_mean"] = [x.get("reward_mean") for x in ok]
        out["params"] = ok[0]["params"]
        if system == "mutualrl" and "bound_inputs" in ok[0]:
            out["bound_inputs"] = ok[0]["bound_inputs"]
    if "mutualrl_tokens_per_s" in out and "trl_tokens_per_s" in out:
        out["ratio"] = out["mutualrl_tokens_per_s"] / out["trl_tokens_per_s"]
        out["ratio_cpu"] = out["mutualrl_cpu_tokens_per_s"] / out["trl_cpu_tokens_per_s"]
        out["ratio_generated"] = out["mutualrl_generated_tokens_per_s"] / out["trl_generated_tokens_per_s"]
        out["ratio_trained"] = out["mutualrl_trained_tokens_per_s"] / out["trl_trained_tokens_per_s"]
        out["ratio_per_repeat"] = [a / b for a, b in zip(out["mutualrl_per_repeat_tokens_per_s"],
                                                         out["trl_per_repeat_tokens_per_s"])]
        out["peak_ratio"] = out["mutualrl_peak_mb"] / out["trl_peak_mb"]
    return out


def add_mfu(case: dict[str, Any], peaks: dict[str, float]) -> None:
    """Training (and generation) MFU of both systems from the measured matmul peak."""
    peak = peaks.get(case["dtype"])
    if not peak:
        return
    case["matmul_peak_flops"] = peak
    for system in ("mutualrl", "trl"):
        if f"{system}_train_flops_per_s" in case:
            case[f"{system}_mfu"] = case[f"{system}_train_flops_per_s"] / peak
            case[f"{system}_gen_mfu"] = case[f"{system}_gen_flops_per_s"] / peak
            # FLOPs actually executed (mutualrl runs a group's prompt once): hardware FLOPs utilisation
            case[f"{system}_hfu"] = case[f"{system}_train_exec_flops_per_s"] / peak


def add_bounds(case: dict[str, Any], peak: float, bandwidth: float) -> None:
    """The physical limits of the case's work on this machine, beside the measured figures.

    Decoding: each step reads every weight and the batch's KV cache so far, so the sampling time is
    at least ``decode bytes / bandwidth`` (or ``decode FLOPs / peak`` where that is larger), plus
    the prefill's FLOPs at peak. Training: the update's model FLOPs (~6 N per token plus the
    attention products) at peak. ``*_frac_of_bound`` = measured / bound throughput."""
    b = case.get("bound_inputs")
    if not b or not peak or not bandwidth:
        return
    tok = b["completion_tokens_per_step"]
    decode_s = max(b["decode_bytes_per_step"] / bandwidth, b["decode_flops_per_step"] / peak)
    gen_s = b["prefill_flops_per_step"] / peak + decode_s
    train_s = b["train_flops_per_step"] / peak
    bounds = {"memory_bandwidth_bytes_per_s": bandwidth, "matmul_peak_flops": peak,
              "decode_memory_bound": b["decode_bytes_per_step"] / bandwidth >= b["decode_flops_per_step"] / peak,
              "gen_tokens_per_s": tok / gen_s, "train_tokens_per_s": tok / train_s,
              "tokens_per_s": tok / (gen_s + train_s)}
    case["bounds"] = bounds
    for system in ("mutualrl", "trl"):
        for key, bound in (("generated_tokens_per_s", "gen_tokens_per_s"), ("trained_tokens_per_s", "train_tokens_per_s"),
                           ("tokens_per_s", "tokens_per_s")):
            if f"{system}_{key}" in case:
                case[f"{system}_{key.replace('_per_s', '')}_frac_of_bound"] = case[f"{system}_{key}"] / bounds[bound]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and one repeat per case")
    ap.add_argument("--cases", default=None, help=f"comma list of {', '.join(CASES)} "
                    "(default zoo,smollm2)")
    ap.add_argument("--repeats", type=int, default=None, help="alternations per case (default 3; quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: zoo 40, smollm2 5; quick 6 / 3)")
    ap.add_argument("--warmup", type=int, default=None, help="uncounted first steps (default 2; quick 1)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="num_generations (group size)")
    ap.add_argument("--completion-len", type=int, default=32, help="max_completion_length (always reached)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both systems")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/vs_trl.json, vs_trl_gpu.json "
                    "on CUDA, *_quick.json with --quick); written exactly where given")
    ap.add_argument("--trl-process-settings", action="store_true",
                    help="give TRL's process the settings mutualrl's workers make for themselves (glibc heap kept, "
                         "denormals flushed): how much of the lead is those settings")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        s = json.loads(args.child)
        res = child_mutualrl(s) if s["system"] == "mutualrl" else child_trl(s)
        _perf.emit(res)
        return 0

    import torch

    torch.set_num_threads(args.threads)
    cases = (args.cases or ("zoo,smollm2")).split(",")
    t0 = time.perf_counter()
    loads = [__import__("os").getloadavg()[0]]
    dtypes = sorted({CASES[c][1] for c in cases})
    peaks = {dt: _perf.matmul_peak(dt, args.device) for dt in dtypes}
    bandwidth = _perf.memory_bandwidth(args.device)
    for c in cases:  # build/locate models before timing anything
        print(f"{c}: {_perf.model_dir(CASES[c][0])[1]}", file=sys.stderr)
    results: dict[str, Any] = {}
    for c in cases:
        s = settings(args, c)
        print(f"case {c}: {s['steps']} steps ({s['warmup']} warmup)", file=sys.stderr)
        results[c] = run_case(c, s, args.repeats or (1 if args.quick else 3))
        results[c]["model_desc"] = _perf.model_dir(CASES[c][0])[1]
        loads.append(__import__("os").getloadavg()[0])
    peaks_end = {dt: _perf.matmul_peak(dt, args.device) for dt in dtypes}
    peaks = {dt: max(peaks[dt], peaks_end[dt]) for dt in dtypes}
    bandwidth = max(bandwidth, _perf.memory_bandwidth(args.device))
    for c in cases:
        add_mfu(results[c], peaks)
        add_bounds(results[c], peaks[CASES[c][1]], bandwidth)
    print_table(results)
    data = {"cases": results, "matmul_peak_flops": peaks, "memory_bandwidth_bytes_per_s": bandwidth, "matmul_peak_flops_start_end": [peaks, peaks_end],
            "load_avg_1m_seen": loads, "machine": machine(), "quick": args.quick,
            "wall_s": time.perf_counter() - t0, "git_rev": git_rev(), "device": args.device}
    if args.out:
        write_result_to(Path(args.out), data)
    else:
        write_result(("vs_trl_gpu" if args.device == "cuda" else "vs_trl") + ("_quick" if args.quick else ""), data)
    return 0


def print_table(results: dict[str, Any]) -> None:
    """The human-readable table."""
    def f(x: Any, p: str = ".1f") -> str:
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, p)

    print(f"{'case':14s} {'system':9s} {'tok/s':>8s} {'gen tok/s':>9s} {'train tok/s':>11s} {'s/step':>7s} "
          f"{'peak MB':>8s} {'MFU':>6s}")
    for c, r in results.items():
        for system in ("mutualrl", "trl"):
            print(f"{c:14s} {system:9s} {f(r.get(f'{system}_tokens_per_s')):>8s} "
                  f"{f(r.get(f'{system}_generated_tokens_per_s')):>9s} "
                  f"{f(r.get(f'{system}_trained_tokens_per_s')):>11s} {f(r.get(f'{system}_step_s'), '.3f'):>7s} "
                  f"{f(r.get(f'{system}_peak_mb'), '.0f'):>8s} {f(r.get(f'{system}_mfu'), '.1%'):>6s}")
        print(f"{c:14s} ratio mutualrl/TRL {f(r.get('ratio'), '.2f')}x (gen {f(r.get('ratio_generated'), '.2f')}x, "
              f"train {f(r.get('ratio_trained'), '.2f')}x; per CPU-s {f(r.get('ratio_cpu'), '.2f')}x), "
              f"peak {f(r.get('peak_ratio'), '.2f')}x")
        b = r.get("bounds")
        if b:
            print(f"{c:14s} bound      {f(b['tokens_per_s']):>8s} {f(b['gen_tokens_per_s']):>9s} "
                  f"{f(b['train_tokens_per_s']):>11s}   (decode {'memory' if b['decode_memory_bound'] else 'FLOP'}-bound)")


if __name__ == "__main__":
    raise SystemExit(main())
