"""THL benchmark: residual per real tokenizer pair, alignment overhead vs bare encoding, sum error.

Run from the repo root: ``python benchmarks/thl.py [--quick]``. Writes ``benchmarks/results/thl.json``.

Texts are reasoning-gym-style completions (``basic_arithmetic`` and ``chain_sum`` questions with a
short worked answer). For every unordered pair of the real vocabularies (cl100k, minilm, smollm2,
gemma3) it measures, alternating in the same process:

* **bare** -- batch encode-with-offsets of the texts by both tokenizers (ids and offsets read);
* **THL** -- the same encoding plus alignment of every text and projection of one log-prob-like
  value per source token onto the target tokens.

``overhead_ratio`` = THL time / bare time (median over rounds; the headline is over all pairs
together). ``max_sum_error`` is the largest per-chunk or total sum mismatch after projection.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from mutualrl.thl import align_encodings_batch, encode_batch, pair_report, project_batch
from mutualrl.thl.retokenize import backend_of
from mutualrl.thl.vocabs import load_backend

NAMES = ("cl100k", "minilm", "smollm2", "gemma3")
SEED = 1234

_OPENERS = (
    "Let's think step by step.",
    "We evaluate the expression from left to right.",
    "First, rewrite the problem.",
    "Okay, so I need to compute this carefully.",
    "",
)
_CLOSERS = (
    "The answer is {a}.",
    "So the final answer is {a}.",
    "Answer: {a}",
    "Therefore the result is **{a}**.",
    "<answer>{a}</answer>",
)


def _steps(expr: str) -> list[str]:
    """A few worked steps for a flat +/- expression (left to right), else one restatement."""
    tokens = expr.replace("(", " ( ").replace(")", " ) ").split()
    if any(t in ("(", ")", "*", "/") for t in tokens) or len(tokens) < 3:
        return [f"We need {expr}."]
    acc = int(tokens[0])
    out = []
    for op, num in zip(tokens[1::2], tokens[2::2]):
        n = int(num)
        new = acc + n if op == "+" else acc - n
        out.append(f"{acc} {op} {n} = {new}")
        acc = new
    return out


def make_texts(n: int, seed: int = SEED) -> list[str]:
    """``n`` reasoning-gym-style completions (question, worked steps, final answer)."""
    import reasoning_gym

    half = n // 2
    items = list(reasoning_gym.create_dataset("basic_arithmetic", size=half, seed=seed))
    items += list(reasoning_gym.create_dataset("chain_sum", size=n - half, seed=seed + 1))
    rng = random.Random(seed)
    texts = []
    for item in items:
        meta = item.get("metadata", {})
        expr = meta.get("expression") or item["question"].rsplit(":", 1)[-1].strip(" =.")
        lines = [rng.choice(_OPENERS), f"The question: {item['question']}"]
        lines += _steps(str(expr))
        lines.append(rng.choice(_CLOSERS).format(a=item["answer"]))
        texts.append("\n".join(line for line in lines if line))
    return texts


def _bare(tokenizers: list[Any], texts: list[str]) -> float:
    t0 = time.perf_counter()
    for tok in tokenizers:
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            enc.ids  # noqa: B018 -- reading ids and offsets is part of encoding for a consumer
            enc.offsets  # noqa: B018
    return time.perf_counter() - t0


def _thl(src: Any, tgt: Any, texts: list[str], values: list[np.ndarray]) -> tuple[float, list[Any], list[np.ndarray]]:
    t0 = time.perf_counter()
    se = encode_batch(src, texts)
    te = encode_batch(tgt, texts)
    als = align_encodings_batch(texts, se, te, source_tokenizer=src, target_tokenizer=tgt)
    out = project_batch(als, values)
    return time.perf_counter() - t0, als, out


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform()}
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        info.update(torch=None, torch_threads=None)
    import tokenizers

    info["tokenizers"] = tokenizers.__version__
    return info


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 texts and 3 timing rounds")
    ap.add_argument("--texts", type=int, default=None, help="number of texts (default 10,000; quick 1,000)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds per pair (default 3)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "thl.json"))
    args = ap.parse_args(argv)
    n = args.texts or (1000 if args.quick else 10000)
    rounds = args.rounds or 3
    wall0 = time.perf_counter()
    git_rev = _git_rev()  # the code that runs, even if HEAD moves during the run

    texts = make_texts(n)
    chars = sum(len(t) for t in texts)
    toks = {name: backend_of(load_backend(name)) for name in NAMES}
    rng = np.random.default_rng(SEED)
    counts = {name: [len(e) for e in encode_batch(tok, texts)] for name, tok in toks.items()}
    # warm up (byte tables, allocator) outside the timings
    for name in NAMES:
        _thl(toks[name], toks[name], texts[:50], [np.zeros(c) for c in counts[name][:50]])

    pairs: dict[str, dict[str, Any]] = {}
    total_bare = total_thl = 0.0
    max_err = 0.0
    for a, b in itertools.combinations(NAMES, 2):
        values = [rng.normal(-2.0, 1.5, size=c) for c in counts[a]]
        bare_t, thl_t = [], []
        als: list[Any] = []
        outs: list[np.ndarray] = []
        for r in range(rounds):  # alternate, starting with a different one each round
            if r % 2 == 0:
                bare_t.append(_bare([toks[a], toks[b]], texts))
                t, als, outs = _thl(toks[a], toks[b], texts, values)
                thl_t.append(t)
            else:
                t, als, outs = _thl(toks[a], toks[b], texts, values)
                thl_t.append(t)
                bare_t.append(_bare([toks[a], toks[b]], texts))
        err = 0.0
        for al, v, o in zip(als, values, outs):
            if len(al.target) == 0:
                continue
            d = np.abs(al.chunk_sums(o, "target") - al.chunk_sums(v, "source"))
            err = max(err, float(d.max(initial=0.0)), abs(float(o.sum() - v.sum())))
        max_err = max(max_err, err)
        rep = pair_report(als)
        bare_med, thl_med = statistics.median(bare_t), statistics.median(thl_t)
        total_bare += bare_med
        total_thl += thl_med
        pairs[f"{a}-{b}"] = {
            "roundtrip_fail_rate": rep.roundtrip_fail_rate,
            "source_roundtrip_fail_rate": rep.source_roundtrip_fail_rate,
            "target_roundtrip_fail_rate": rep.target_roundtrip_fail_rate,
            "non_1to1_char_frac": rep.non_1to1_char_frac,
            "mean_chunk_tokens": rep.mean_chunk_tokens,
            "max_chunk_tokens": rep.max_chunk_tokens,
            "source_lost_char_frac": rep.source_lost_char_frac,
            "target_lost_char_frac": rep.target_lost_char_frac,
            "inexact_chunk_frac": rep.inexact_chunk_frac,
            "bare_s": bare_med,
            "thl_s": thl_med,
            "overhead_ratio": thl_med / bare_med,
            "max_sum_error": err,
        }

    result = {
        "pairs": pairs,
        "texts": n,
        "chars": chars,
        "thl_chars_per_s": chars * len(pairs) / total_thl,
        "bare_encode_chars_per_s": chars * len(pairs) / total_bare,
        "overhead_ratio": total_thl / total_bare,
        "max_sum_error": max_err,
        "seed": SEED,
        "rounds": rounds,
        "machine": _machine(),
        "quick": bool(args.quick),
        "wall_s": time.perf_counter() - wall0,
        "git_rev": git_rev,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _print_table(result)
    print(f"wrote {out}")
    return 0


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"THL on {result['texts']} reasoning-gym-style completions ({result['chars']} chars)")
    for col in ("pair", "round-trip fail", "non-1:1 chars", "mean chunk tok", "max chunk tok",
                "inexact chunks", "overhead", "max sum err"):
        table.add_column(col, justify="right")
    for name, p in result["pairs"].items():
        table.add_row(name, f"{p['roundtrip_fail_rate']:.3f}", f"{p['non_1to1_char_frac']:.3f}",
                      f"{p['mean_chunk_tokens']:.3f}", str(p["max_chunk_tokens"]),
                      f"{p['inexact_chunk_frac']:.4f}", f"{p['overhead_ratio']:.2f}x",
                      f"{p['max_sum_error']:.1e}")
    console = Console(width=140)
    console.print(table)
    console.print(
        f"overall overhead_ratio {result['overhead_ratio']:.2f}x (target <= 2.0, goal <= 1.3); "
        f"THL {result['thl_chars_per_s'] / 1e6:.2f} M chars/s vs bare encode "
        f"{result['bare_encode_chars_per_s'] / 1e6:.2f} M chars/s; max_sum_error {result['max_sum_error']:.1e}; "
        f"wall {result['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
