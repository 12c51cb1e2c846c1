"""How mutualrl's step time grows, what sharing costs, and whether bf16 pays on this machine.

    python benchmarks/scaling.py [--quick] [--sections group_size,completion_len,num_policies,sharing,dtype]
                                 [--threads 2]

* ``group_size``: one zoo-sized policy (GPT-2 family), 2 prompts per step, completion length 32,
  group size G in 2, 4, 8, 16.
* ``completion_len``: the same policy, G = 8, completion length 32, 64, 128.
* ``num_policies``: K = 1..4 heterogeneous zoo-sized policies (GPT-2, Llama, GPT-NeoX, GPT-2),
  ``independent``, in-process workers called one after another.
  In these three series every completion is exactly the completion length (no stop token), so
  the work per step is fixed and the expected growth is linear.
* ``sharing``: two zoo policies (GPT-2 + Llama; the built zoo when it is cached, else a short
  SFT warm start of the zoo specs built here) on the demo's settings (16 prompts x 8, natural
  stopping), strategies ``independent``, ``sgt`` and ``prp`` alternated; ``sharing_overhead``
  = per-step time with the strategy / per-step time with ``independent``.
* ``dtype``: the warm-started GPT-2 zoo policy trained for a short GRPO run in float32 and in
  ``dtype: bfloat16`` (autocast), same seed: step time, reward and loss curves, and this
  machine's matmul peak for both dtypes.

Step times are medians over the measured steps (the first ``warmup`` steps of every run are
dropped), wall clock and CPU time. Writes ``benchmarks/results/scaling.json`` and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _perf
from _common import RESULTS, git_rev, machine, write_result

POLICY_SPECS = ["gpt2-add", "llama-sub", "neox-mix", "gpt2-add"]
SECTIONS = ["group_size", "completion_len", "num_policies", "sharing", "dtype"]


# ----------------------------------------------------------------------------- one measured run
def measure(policies: list[tuple[str, str]], *, steps: int, warmup: int, threads: int,
            full_length: bool, grpo: dict[str, Any], prompts: int, strategy: str = "independent",
            seed: int = 0) -> dict[str, Any]:
    """Run :class:`MutualTrainer` in this process; per-step wall/CPU times after ``warmup``.

    ``policies`` is ``[(name, model_dir), ...]``. ``full_length`` removes the stop token so
    every completion has ``max_completion_length`` tokens.
    """
    import torch

    from mutualrl.allocation import SequentialScheduler
    from mutualrl.run.trainer import MutualTrainer

    class Sched(SequentialScheduler):
        def start(self, cfg: Any, run_dir: Any) -> list[dict[str, Any]]:
            infos = super().start(cfg, run_dir)
            if full_length:
                for w in self.workers:
                    w.policy.engine.eos_ids = [int(w.policy.model.config.vocab_size) + 7]
            return infos

    stamps: list[tuple[float, float]] = []

    class Trainer(MutualTrainer):
        def evaluate(self, step: int) -> list[dict[str, Any]]:
            out = super().evaluate(step)
            if not stamps:
                stamps.append((time.perf_counter(), time.process_time()))
            return out

        def _log(self, rows: list[dict[str, Any]]) -> None:
            super()._log(rows)
            if rows and rows[0].get("event") != "eval":
                stamps.append((time.perf_counter(), time.process_time()))

    cfg = {
        "policies": [{"name": n, "model": str(d)} for n, d in policies],
        "task": {"preset": "zoo", "test_size": 100},
        "grpo": {**grpo, "dynamic_sampling": "off"}, "sharing": {"strategy": strategy}, "steps": steps,
        "prompts_per_step": prompts,
        "eval_every": 10 ** 6, "eval_size": 2, "eval_batch_size": 2, "checkpoint_every": 10 ** 6,
        "seed": seed, "exchange": "memory://", "scheduler": "sequential", "threads": threads,
    }
    torch.set_num_threads(threads)
    tr = Trainer(cfg, None, scheduler=Sched(threads), progress=False)
    tr.train()
    walls = [b[0] - a[0] for a, b in itertools.pairwise(stamps)][warmup:]
    cpus = [b[1] - a[1] for a, b in itertools.pairwise(stamps)][warmup:]
    rows = [r for r in tr.history if r.get("event") != "eval"]
    per_step = [r for r in rows if r["step"] >= warmup]
    out = {"step_s": statistics.median(walls), "step_cpu_s": statistics.median(cpus), "step_s_all": walls,
           "step_cpu_s_all": cpus}
    for key in ("gen_tokens", "train_tokens", "sgt_rescue", "prp_peer_samples", "generate_s", "train_s",
                "query_s", "share_s"):
        vals = [r[key] for r in per_step if key in r]
        if vals:
            out[key] = sum(vals) / max(1, len({r["step"] for r in per_step}))
    out["reward_mean"] = [statistics.mean(r["reward_mean"] for r in rows if r["step"] == s)
                          for s in sorted({r["step"] for r in rows})]
    out["loss"] = [statistics.mean(r.get("loss", 0.0) for r in rows if r["step"] == s)
                   for s in sorted({r["step"] for r in rows})]
    out["grad_norm"] = [statistics.mean(r.get("grad_norm", 0.0) for r in rows if r["step"] == s)
                        for s in sorted({r["step"] for r in rows})]
    return out


# ----------------------------------------------------------------------------- models
def long_models() -> dict[str, Path]:
    """Zoo-sized untrained policies with 256 positions (room for 128-token completions)."""
    out = {}
    for spec in sorted(set(POLICY_SPECS)):
        out[spec] = _perf.model_dir(f"zoo:{spec}", max_positions=256)[0]
    return out


def warm_models(names: list[str], sft_steps: int) -> tuple[dict[str, Path], str]:
    """Zoo policies with some skill: the built zoo when cached, else a short SFT of the zoo specs."""
    from mutualrl import zoo

    built = {n: zoo.policy_dir(n, seed=0) for n in names}
    if all((d / "zoo_card.json").is_file() and (d / "model.safetensors").is_file() for d in built.values()):
        return built, "built zoo"
    specs = {n: dataclasses.replace(zoo.ZOO[n], sft_max_steps=sft_steps, sft_eval_every=sft_steps,
                                    bands={k: (0.0, 1.0) for k in zoo.ZOO[n].bands}, band_margin=0.0)
             for n in names}
    dirs = zoo.build_zoo(names, seed=0, cache_dir=_perf.CACHE / "zoo-warm", progress=False, specs=specs)
    return dirs, f"zoo specs with a {sft_steps}-step SFT warm start (zoo not built)"


# ----------------------------------------------------------------------------- sections
def series(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One of the linear-growth series (full-length completions, ``independent``)."""
    models = long_models()
    steps, warmup = (4, 1) if args.quick else (7, 2)
    base = {"num_generations": 8, "max_completion_length": 32, "learning_rate": 1e-5}
    points: list[tuple[Any, list[tuple[str, str]], dict[str, Any]]] = []
    if name == "group_size":
        for g in (2, 4, 8, 16):
            points.append((g, [("p0", models["gpt2-add"])], dict(base, num_generations=g)))
    elif name == "completion_len":
        for c in (32, 64, 128):
            points.append((c, [("p0", models["gpt2-add"])], dict(base, max_completion_length=c)))
    elif name == "num_policies":
        for k in (1, 2, 3, 4):
            pols = [(f"p{i}", models[POLICY_SPECS[i]]) for i in range(k)]
            points.append((k, pols, base))
    res = []
    for x, pols, grpo in points:
        m = measure(pols, steps=steps, warmup=warmup, threads=args.threads, full_length=True, grpo=grpo,
                    prompts=2)
        print(f"  {name}={x}: {m['step_s']:.3f} s/step ({m['step_cpu_s']:.3f} CPU-s)", file=sys.stderr)
        res.append({"x": x, **{k: m[k] for k in ("step_s", "step_cpu_s", "step_s_all", "gen_tokens",
                                                 "train_tokens") if k in m}})
    xs = [r["x"] for r in res]
    ys = [r["step_s"] for r in res]
    return {"x": xs, "step_s": ys, "step_cpu_s": [r["step_cpu_s"] for r in res], "points": res,
            "linear_fit": _linear_fit(xs, ys), "linear_fit_cpu": _linear_fit(xs, [r["step_cpu_s"] for r in res])}


def _linear_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least-squares ``y = a + b x`` and its R² (how linear the growth is)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return {"intercept": a, "slope": b, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def sharing(args: argparse.Namespace) -> dict[str, Any]:
    """Per-step time of ``sgt`` and ``prp`` over ``independent`` on the same two policies."""
    dirs, desc = warm_models(["gpt2-add", "llama-sub"], 300)
    pols = [("gpt2", dirs["gpt2-add"]), ("llama", dirs["llama-sub"])]
    steps, warmup = (4, 1) if args.quick else (8, 2)
    repeats = 1 if args.quick else 2
    grpo = {"num_generations": 8, "max_completion_length": 8, "learning_rate": 1e-4}
    runs: dict[str, list[dict[str, Any]]] = {"independent": [], "sgt": [], "prp": []}
    for _ in range(repeats):
        for strat, store in runs.items():
            m = measure(pols, steps=steps, warmup=warmup, threads=args.threads, full_length=False, grpo=grpo,
                        prompts=16, strategy=strat)
            store.append(m)
            print(f"  sharing {strat}: {m['step_s']:.3f} s/step ({m['step_cpu_s']:.3f} CPU-s), rescue "
                  f"{m.get('sgt_rescue', 0):.1f}, peer samples {m.get('prp_peer_samples', 0):.1f}", file=sys.stderr)
    med = {s: statistics.median([x for m in ms for x in m["step_s_all"]]) for s, ms in runs.items()}
    med_cpu = {s: statistics.median([x for m in ms for x in m["step_cpu_s_all"]]) for s, ms in runs.items()}
    out: dict[str, Any] = {"models": desc, "settings": {"policies": 2, "prompts_per_step": 16, **grpo,
                                                        "steps": steps, "warmup": warmup, "repeats": repeats},
                           "step_s": med, "step_cpu_s": med_cpu}
    for s in ("sgt", "prp"):
        out[s] = med[s] / med["independent"]
        out[f"{s}_cpu"] = med_cpu[s] / med_cpu["independent"]
    for s, ms in runs.items():
        for key in ("sgt_rescue", "prp_peer_samples", "query_s", "share_s", "train_s", "gen_tokens",
                    "train_tokens"):
            vals = [m[key] for m in ms if key in m]
            if vals:
                out.setdefault("per_strategy", {}).setdefault(s, {})[key] = statistics.mean(vals)
    return out


def dtype_section(args: argparse.Namespace) -> dict[str, Any]:
    """fp32 vs bf16 autocast: matmul peaks, step time, reward/loss curves of a short GRPO run."""
    dirs, desc = warm_models(["gpt2-add"], 300)
    steps = 8 if args.quick else 30
    grpo = {"num_generations": 8, "max_completion_length": 8, "learning_rate": 1e-4}
    out: dict[str, Any] = {"model": desc, "steps": steps,
                           "matmul_peak_flops": {dt: _perf.matmul_peak(dt) for dt in ("float32", "bfloat16")}}
    for dt in ("float32", "bfloat16"):
        m = measure([("gpt2", dirs["gpt2-add"])], steps=steps, warmup=2, threads=args.threads, full_length=False,
                    grpo=dict(grpo, dtype=dt), prompts=8)
        out[dt] = {k: m[k] for k in ("step_s", "step_cpu_s", "reward_mean", "loss", "grad_norm")}
        print(f"  dtype {dt}: {m['step_s']:.3f} s/step, reward first/last 5 "
              f"{statistics.mean(m['reward_mean'][:5]):.3f}/{statistics.mean(m['reward_mean'][-5:]):.3f}",
              file=sys.stderr)
    out["bf16_speedup"] = out["float32"]["step_s"] / out["bfloat16"]["step_s"]
    out["bf16_matmul_speedup"] = out["matmul_peak_flops"]["bfloat16"] / out["matmul_peak_flops"]["float32"]
    return out


# ----------------------------------------------------------------------------- plot
def plot(data: dict[str, Any], path: Path) -> None:
    """Four panels: the three growth series with their linear fits, and sharing overhead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    labels = {"group_size": "group size G", "completion_len": "completion length (tokens)",
              "num_policies": "number of policies K"}
    for ax, key in zip(axes[:3], ("group_size", "completion_len", "num_policies")):
        s = data.get(key)
        if not s:
            ax.set_visible(False)
            continue
        ax.plot(s["x"], s["step_s"], "o-", label="wall")
        ax.plot(s["x"], s["step_cpu_s"], "s--", label="CPU")
        fit = s["linear_fit"]
        xs = [min(s["x"]), max(s["x"])]
        ax.plot(xs, [fit["intercept"] + fit["slope"] * x for x in xs], ":", color="gray",
                label=f"linear fit R²={fit['r2']:.3f}")
        ax.set_xlabel(labels[key])
        ax.set_ylabel("s / step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax = axes[3]
    sh = data.get("sharing_overhead")
    if sh:
        names = ["independent", "sgt", "prp"]
        vals = [1.0, sh["sgt"], sh["prp"]]
        ax.bar(names, vals, color=["#999", "#4a8", "#48c"])
        for i, v in enumerate(vals):
            ax.text(i, v + 0.02, f"{v:.2f}x", ha="center")
        ax.axhline(1.15, ls=":", color="#4a8")
        ax.axhline(1.5, ls=":", color="#48c")
        ax.set_ylabel("step time / independent")
        ax.set_title("sharing overhead (2 policies)")
    else:
        ax.set_visible(False)
    fig.suptitle(f"mutualrl step time growth ({data['machine']['cpu_count']} CPUs, "
                 f"{data['threads']} torch threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, one repeat")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="result name (default scaling / scaling_quick)")
    args = ap.parse_args(argv)
    import os

    import torch

    torch.set_num_threads(args.threads)
    from mutualrl.run.quiet import silence_transformers

    silence_transformers()
    t0 = time.perf_counter()
    loads = [os.getloadavg()[0]]
    data: dict[str, Any] = {"threads": args.threads}
    for sec in args.sections.split(","):
        print(f"section {sec}", file=sys.stderr)
        if sec in ("group_size", "completion_len", "num_policies"):
            data[sec] = series(args, sec)
        elif sec == "sharing":
            data["sharing_overhead"] = sharing(args)
        elif sec == "dtype":
            data["dtype"] = dtype_section(args)
        else:
            raise SystemExit(f"unknown section {sec!r}; valid: {', '.join(SECTIONS)}")
        loads.append(os.getloadavg()[0])
    data.update({"load_avg_1m_seen": loads, "machine": machine(), "quick": args.quick,
                 "wall_s": time.perf_counter() - t0, "git_rev": git_rev()})
    name = args.out or ("scaling_quick" if args.quick else "scaling")
    print_table(data)
    write_result(name, data)
    try:
        plot(data, RESULTS / f"{name}.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return 0


def print_table(data: dict[str, Any]) -> None:
    """The human-readable summary."""
    for key in ("group_size", "completion_len", "num_policies"):
        s = data.get(key)
        if s:
            pts = "  ".join(f"{x}: {y:.3f}s" for x, y in zip(s["x"], s["step_s"]))
            print(f"{key:15s} {pts}   (linear R² {s['linear_fit']['r2']:.3f}, CPU R² {s['linear_fit_cpu']['r2']:.3f})")
    sh = data.get("sharing_overhead")
    if sh:
        print(f"sharing overhead: sgt {sh['sgt']:.2f}x (CPU {sh['sgt_cpu']:.2f}x), prp {sh['prp']:.2f}x "
              f"(CPU {sh['prp_cpu']:.2f}x)  [{sh['models']}]")
    d = data.get("dtype")
    if d:
        print(f"dtype: bf16/fp32 step speedup {d['bf16_speedup']:.2f}x, matmul {d['bf16_matmul_speedup']:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
