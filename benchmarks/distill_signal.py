"""Where a peer's knowledge lands: ``distill``'s chunk-level signal on real completions of the real
pair, and THL's chunk statistics on their own completions, numbers above all.

Loads SmolLM2-135M-Instruct and Gemma-3-270M as ``examples/real_size.yaml`` configures them (fp32,
this CPU), samples one completion per word problem from each (temperature 1), and lets each score
the other's completions exactly as the ``distill`` serve phase does (:func:`mutualrl.thl.scores.score_chunks`,
one forward of the scorer, :func:`mutualrl.algorithms.strategies.distill.chunk_signal`, clip 1 nat).
The zoo pair (``zoo:gpt2-add`` x ``zoo:llama-sub``) is measured the same way on its own task.

Per direction it reports, over the learner's completions: the THL chunk statistics (the fraction
of the text in chunks that are not 1:1, characters and tokens per chunk, non-canonical samples),
the same over the characters of numbers (``\\d+``) only, and the share of multi-digit numbers the
two tokenizers cut into a different number of tokens (what breaks token-level cross-tokenizer
distillation, X-Token's finding about GOLD); then the signal: its mean and mean absolute value over
all chunks and over number chunks, and how often it is clipped. The figure plots the per-chunk
signal against the character position for a few completions of each direction, numbers shaded.

    python benchmarks/distill_signal.py                      # 16 problems, both pairs
    python benchmarks/distill_signal.py --problems 4 --pairs zoo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from _common import git_rev, machine, write_result

ROOT = Path(__file__).resolve().parent.parent
FIGURE = ROOT / "docs" / "images" / "distill_signal.png"
NUMBER = re.compile(r"\d+")
CLIP = 1.0


def _policies(pair: str) -> tuple[list[Any], list[Any]]:
    """The pair's two policies (loaded) and the problems they answer."""
    from mutualrl.config.modelref import resolve_model_path
    from mutualrl.config.resolve import load_config
    from mutualrl.rollout.policy import Policy
    from mutualrl.tasks.build import build_task

    if pair == "real":
        cfg = load_config(ROOT / "examples" / "real_size.yaml")
        max_len = 200
    else:
        cfg = load_config({"policies": [{"name": "gpt2-add", "model": "zoo:gpt2-add"},
                                        {"name": "llama-sub", "model": "zoo:llama-sub"}],
                           "task": {"preset": "zoo"}, "grpo": {"max_completion_length": 8}})
        max_len = 8
    pols = []
    for i, p in enumerate(cfg.policies):
        opts = dataclasses.replace(cfg.policy_grpo(i), max_completion_length=max_len, num_generations=1)
        pols.append(Policy(p.name, resolve_model_path(p.model), opts, prompt_template=p.prompt_template,
                           system_prompt=p.system_prompt, seed=i))
    task = build_task(cfg.task, run_seed=0)
    return pols, task.problems("test")


def _view(pol: Any) -> Any:
    from mutualrl.algorithms.context import PeerView

    return PeerView(pol.name, pol.tokenizer, pol.tokenizer_id, frozenset(pol.eos_ids), pol.prompt_template,
                    pol.system_prompt)


def _number_chars(text: str) -> set[int]:
    return {i for m in NUMBER.finditer(text) for i in range(m.start(), m.end())}


def _direction(learner: Any, teacher: Any, problems: list[Any], samples: list[Any]) -> dict[str, Any]:
    """THL statistics and the signal of ``teacher`` scoring ``learner``'s samples."""
    import torch

    from mutualrl.algorithms.strategies.distill import chunk_signal
    from mutualrl.experience import PeerScore
    from mutualrl.thl.align import align
    from mutualrl.thl.scores import score_chunks

    me, them = _view(learner), _view(teacher)
    stats = {"chars": 0, "non1to1_chars": 0, "number_chars": 0, "number_non1to1_chars": 0, "chunks": 0,
             "learner_tokens": 0, "teacher_tokens": 0, "noncanonical": 0, "numbers": 0, "numbers_split_apart": 0,
             "unscorable": 0}
    sig_all, sig_num, clipped, curves = [], [], 0, []
    for prob, s in zip(problems, samples, strict=True):
        text = s.text
        al = align(text, learner.tokenizer, teacher.tokenizer)
        nums = _number_chars(text)
        one = al.one_to_one().tolist()
        for k, c in enumerate(al.chunks):
            span = set(range(c.char_start, c.char_end))
            stats["chars"] += len(span)
            stats["number_chars"] += len(span & nums)
            if not one[k]:
                stats["non1to1_chars"] += len(span)
                stats["number_non1to1_chars"] += len(span & nums)
        stats["chunks"] += al.n_chunks
        stats["learner_tokens"] += len(al.source.ids)
        stats["teacher_tokens"] += len(al.target.ids)
        for m in NUMBER.finditer(text):
            if m.end() - m.start() > 1:
                stats["numbers"] += 1
                a = len(learner.tokenizer(m.group(), add_special_tokens=False)["input_ids"])
                b = len(teacher.tokenizer(m.group(), add_special_tokens=False)["input_ids"])
                stats["numbers_split_apart"] += a != b
        ch = score_chunks(text, s.completion_ids, learner.tokenizer, me.format_prompt(prob.question), me.stop_ids,
                          teacher.tokenizer, them.format_prompt(prob.question))
        if ch is None:
            stats["unscorable"] += 1
            continue
        stats["noncanonical"] += not ch.canonical
        ids = list(ch.scorer_ids) + ([int(teacher.tokenizer.eos_token_id)] if ch.stopped else [])
        with torch.no_grad():
            lp = teacher.logprobs([teacher.encode_prompt(prob.question)], [ids or [teacher.pad_id]])[0]
        lp = lp[lp.shape[0] - len(ids):].tolist() if ids else []
        score = PeerScore(rollout_id="r", prompt_id=prob.id, version=0, sample_index=0, chunk_ends=ch.char_ends,
                          chunk_logprobs=tuple(ch.sums(lp, "scorer")), stopped=int(ch.stopped),
                          stop_logprob=float(lp[-1]) if ch.stopped else 0.0, source_policy=teacher.name,
                          source_tokenizer=teacher.tokenizer_id)
        per_token = chunk_signal(text, s.completion_ids, s.logprobs, score, them, me, prob.question, CLIP)
        if per_token is None:
            stats["unscorable"] += 1
            continue
        starts = (0, *ch.char_ends[:-1])
        chunks = []
        for k in range(ch.n):
            a = ch.student_bounds[k]
            if a == ch.student_bounds[k + 1]:
                continue
            v = per_token[a]
            in_number = bool(set(range(starts[k], ch.char_ends[k])) & nums)
            chunks.append((starts[k], ch.char_ends[k], v, in_number))
            sig_all.append(v)
            clipped += abs(v) >= CLIP - 1e-9
            if in_number:
                sig_num.append(v)
        curves.append({"problem": prob.id, "text": text, "chunks": chunks})
    n = max(1, stats["chars"])
    summary = {
        "completions": len(samples), **stats,
        "non1to1_char_frac": stats["non1to1_chars"] / n,
        "number_non1to1_char_frac": stats["number_non1to1_chars"] / max(1, stats["number_chars"]),
        "chars_per_chunk": stats["chars"] / max(1, stats["chunks"]),
        "learner_tokens_per_chunk": stats["learner_tokens"] / max(1, stats["chunks"]),
        "teacher_tokens_per_chunk": stats["teacher_tokens"] / max(1, stats["chunks"]),
        "numbers_split_apart_frac": stats["numbers_split_apart"] / max(1, stats["numbers"]),
        "signal_mean": sum(sig_all) / max(1, len(sig_all)),
        "signal_abs_mean": sum(map(abs, sig_all)) / max(1, len(sig_all)),
        "signal_number_mean": sum(sig_num) / max(1, len(sig_num)),
        "signal_number_abs_mean": sum(map(abs, sig_num)) / max(1, len(sig_num)),
        "clipped_frac": clipped / max(1, len(sig_all)),
    }
    return {"learner": learner.name, "teacher": teacher.name, "summary": summary, "curves": curves}


def _plot(directions: list[dict[str, Any]], path: Path, per_direction: int = 2) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(d, c) for d in directions for c in d["curves"][:per_direction] if c["chunks"]]
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.1 * len(rows)), squeeze=False)
    for ax, (d, c) in zip(axes[:, 0], rows, strict=True):
        for a, b, v, num in c["chunks"]:
            ax.bar((a + b) / 2, v, width=max(b - a, 1) * 0.95, color="tab:orange" if num else "tab:blue")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylim(-CLIP * 1.1, CLIP * 1.1)
        ax.set_ylabel("nats")
        ax.set_title(f"{d['teacher']} scores {d['learner']}'s sample ({c['problem']}); orange: numbers", fontsize=9)
    axes[-1, 0].set_xlabel("character position in the completion")
    fig.suptitle("distill: clipped log pi_peer(chunk) - log pi_self(chunk) per THL chunk", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=16, help="problems per pair (one completion each per policy)")
    ap.add_argument("--pairs", default="real,zoo", help="comma list: real (SmolLM2 x Gemma-3), zoo")
    ap.add_argument("--figure", default=str(FIGURE), help="where the PNG goes")
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(0)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    out: dict[str, Any] = {"pairs": {}}
    for pair in args.pairs.split(","):
        pols, problems = _policies(pair)
        problems = problems[:args.problems]
        samples = {p.name: p.generate([q.question for q in problems], 1) for p in pols}
        dirs = [_direction(a, b, problems, samples[a.name]) for a in pols for b in pols if a is not b]
        out["pairs"][pair] = dirs
        for d in dirs:
            s = d["summary"]
            print(f"{pair:5s} {d['teacher']:>10s} -> {d['learner']:<10s} non1:1 {s['non1to1_char_frac']:.3f} "
                  f"(numbers {s['number_non1to1_char_frac']:.3f}), numbers cut apart {s['numbers_split_apart_frac']:.2f}, "
                  f"signal |mean| {s['signal_abs_mean']:.3f} (numbers {s['signal_number_abs_mean']:.3f}), "
                  f"clipped {s['clipped_frac']:.2f}", flush=True)
    if "real" in out["pairs"]:
        _plot(out["pairs"]["real"], Path(args.figure))
    out.update({"git_rev": git_rev(), "machine": {**machine(), "load_avg": [load0, os.getloadavg()[0]]},
                "wall_s": time.perf_counter() - t0, "clip": CLIP, "problems": args.problems})
    path = write_result("distill_signal", out)
    print(json.dumps({p: [d["summary"] for d in ds] for p, ds in out["pairs"].items()}, indent=1)[:4000])
    print(f"wrote {path}" + (f" and {args.figure}" if "real" in out["pairs"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
