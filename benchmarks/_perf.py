"""Shared pieces of the performance benchmarks (``vs_trl.py``, ``scaling.py``).

* :func:`model_dir` -- the benchmark's models: a zoo policy (the built one when it is in the zoo
  cache, else an untrained model of the same zoo spec and tokenizer kind, built once under
  ``benchmarks/.cache``) and SmolLM2-135M-Instruct (``real:smollm2``).
* :func:`decode_bytes`, :func:`memory_bandwidth` -- the memory-bandwidth bound of decoding;
* :func:`train_flops` -- model FLOPs of one GRPO update (forward + backward), the same formula for
  every system so that MFU ratios equal throughput ratios.
* :func:`matmul_peak` -- the measured dense matmul peak of this machine for a dtype.
* :func:`run_child` -- run one measured case in a fresh Python process (comparable RSS peaks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(__file__).resolve().parent / ".cache"
RESULT_TAG = "BENCH_RESULT "


def model_dir(name: str, max_positions: int | None = None) -> tuple[Path, str]:
    """``(directory, description)`` of a benchmark model: ``zoo:<spec>``, ``smollm2`` or a directory.

    With ``max_positions`` a zoo spec is always the untrained variant with that many positions."""
    if name == "smollm2":
        from mutualrl.config.modelref import ModelRef

        return Path(ModelRef.parse("real:smollm2").resolve(progress=False)), "SmolLM2-135M-Instruct (real:smollm2)"
    if Path(name).is_dir():
        return Path(name), f"model directory {name}"
    if name.startswith("zoo:"):
        from mutualrl import zoo

        spec_name = name[4:]
        built = zoo.policy_dir(spec_name, seed=0)
        if not max_positions and (built / "zoo_card.json").is_file() and (built / "model.safetensors").is_file():
            return built, f"zoo policy {spec_name} (built, SFT warm start)"
        return _untrained_zoo(spec_name, max_positions), f"zoo spec {spec_name} (untrained weights; zoo not built)"
    raise ValueError(f"unknown benchmark model {name!r}")


def _untrained_zoo(spec_name: str, max_positions: int | None = None) -> Path:
    """A model of zoo spec ``spec_name`` with a trained tokenizer and random weights (cached).

    ``max_positions`` widens the position table (long-completion scaling runs)."""
    import dataclasses

    from mutualrl import zoo

    spec = zoo.ZOO[spec_name]
    if max_positions:
        spec = dataclasses.replace(spec, max_positions=max_positions)
    d = CACHE / f"untrained-{spec_name}-{spec.cache_key(0)}"
    if (d / "config.json").is_file():
        return d
    import torch

    from mutualrl.zoo.tokenizers import train_tokenizer

    torch.manual_seed(0)
    task = zoo.default_task(seed=0, test_size=50, train_size=2000)
    texts = [p.question + " Answer: " + p.answer for p in task.problems("train")]
    tok = train_tokenizer(spec.tokenizer, texts, spec.vocab_size)
    model = zoo.build_model(spec, tok)
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, d)
    return d


def param_breakdown(model: Any) -> dict[str, int]:
    """Parameter counts: ``body`` (everything the per-token matmuls touch except the LM head and
    the embedding tables), ``head`` (d x V of the output projection), ``total``."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen: set[int] = set()
    total = 0
    tables = 0
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p is emb or p is head or n.endswith(("wpe.weight", "embed_positions.weight")):
            tables += p.numel()
    return {"body": total - tables, "head": head.numel(), "total": total}


def train_flops(params: dict[str, int], n_layer: int, d_model: int, seq_tokens: int,
                completion_tokens: int, rows: int, seq_len: int) -> float:
    """Model FLOPs of one forward + backward over a batch (the GRPO update).

    ``6 * body * seq_tokens`` (all prompt + completion tokens pass every layer), ``6 * d * V`` for
    the LM head on the completion positions only (both systems keep only those logits), and the
    attention score/value products ``12 * n_layer * d * L`` per token (``L`` = padded length).
    """
    dense = 6.0 * params["body"] * seq_tokens
    head = 6.0 * params["head"] * (completion_tokens + rows)
    attn = 12.0 * n_layer * d_model * seq_len * seq_tokens
    return dense + head + attn


def gen_flops(params: dict[str, int], n_layer: int, d_model: int, prompt_tokens: int,
              gen_tokens: int, seq_len: int) -> float:
    """Model FLOPs of sampling: a prefill over the prompts plus one forward per new token."""
    fwd_tok = 2.0 * params["body"] + 4.0 * n_layer * d_model * seq_len
    return fwd_tok * (prompt_tokens + gen_tokens) + 2.0 * params["head"] * gen_tokens


def decode_bytes(weight_bytes: float, n_layer: int, kv_dim: int, elem_bytes: int, rows: int,
                 prompt_len: int, new_tokens: int) -> float:
    """Bytes a batched decoder must read from memory to sample ``new_tokens`` tokens for ``rows``
    sequences after a ``prompt_len`` prefill: every decoding step reads every weight once (the
    batch shares them) and each row's whole KV cache so far (keys and values of every layer)."""
    cache_tokens = rows * sum(prompt_len + t for t in range(new_tokens))
    return weight_bytes * new_tokens + 2.0 * n_layer * kv_dim * elem_bytes * cache_tokens


def memory_bandwidth(device: str = "cpu", mbytes: int = 512, seconds: float = 1.5) -> float:
    """Best achieved read bandwidth in bytes/s (a reduction over a ``mbytes`` fp32 tensor, far larger
    than the caches; torch threads as set)."""
    import torch

    x = torch.ones(mbytes * 2 ** 18, device=device)  # 4 bytes each
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t))
        if time.perf_counter() > deadline:
            return best


def matmul_peak(dtype: str = "float32", device: str = "cpu", n: int = 1024, seconds: float = 1.5) -> float:
    """Best achieved FLOP/s of an ``n x n`` matmul in ``dtype`` (torch threads as set)."""
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    best = 0.0
    deadline = time.perf_counter() + seconds
    reps = 2
    while True:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        dt_s = time.perf_counter() - t
        best = max(best, 2.0 * n ** 3 * reps / dt_s)
        if time.perf_counter() > deadline:
            return best
        if dt_s < 0.05:
            reps *= 2


def run_child(script: Path, spec: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
    """Run ``script --child '<spec json>'`` in a fresh interpreter; return its result dict.

    The child prints one line ``BENCH_RESULT <json>``; anything else it prints is passed through to
    stderr. A failing child returns ``{"error": ...}`` instead of raising.
    """
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    threads = spec.get("threads")
    if threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[k] = str(threads)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(script), "--child", json.dumps(spec)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s", "wall_s": time.perf_counter() - t0}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
    if result is None:
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"child exited {proc.returncode}: {tail}", "wall_s": time.perf_counter() - t0}
    result["child_wall_s"] = time.perf_counter() - t0
    return result


def emit(result: dict[str, Any]) -> None:
    """Print a child's result line (what :func:`run_child` reads)."""
    import resource

    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(RESULT_TAG + json.dumps(result), flush=True)


def median(xs: list[float]) -> float:
    """Median of a non-empty list (``nan`` when empty)."""
    import statistics

    return statistics.median(xs) if xs else float("nan")
