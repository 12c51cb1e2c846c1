"""Training log-probs on a large vocabulary: one B x C x V logits tensor versus a chunked LM head.

    python benchmarks/logprob_chunks.py [--quick] [--model real:gemma3] [--rows 16] [--completion 32]

Gemma-3's 262k vocabulary makes the logits the dominant cost of the update. mutualrl computes
training log-probs from the decoder's hidden states at completion positions and runs the LM head
over them in chunks of at most ``Policy.logits_budget`` logits (recomputed in backward when there is
more than one chunk). This runs one forward + backward of the log-probs of ``--rows`` completions
of ``--completion`` tokens, in a fresh process per setting (so peak RSS compares), alternated
``--repeats`` times: ``one_chunk`` (budget large enough for all logits at once: what computing
every completion position's logits together costs) and ``chunked`` (the default budget).

Writes ``benchmarks/results/logprob_chunks.json``: per setting the median seconds, peak RSS (MB) and
the number of chunks, and the largest log-prob difference between the two (they must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from _common import git_rev, machine, write_result


def child(model: str, rows: int, completion: int, budget: int | None) -> dict:
    import torch

    from mutualrl.config import GRPOOptions
    from mutualrl.config.modelref import resolve_model_path
    from mutualrl.rollout.policy import LOGITS_BUDGET, Policy

    torch.set_num_threads(os.cpu_count() or 1)
    pol = Policy("p", resolve_model_path(model), GRPOOptions(max_completion_length=completion),
                 prompt_template="Question: {question}\nAnswer:")
    pol.logits_budget = budget or LOGITS_BUDGET
    g = torch.Generator().manual_seed(0)
    vocab = pol.model.get_output_embeddings().weight.shape[0]
    prompts = [pol.encode_prompt(f"What is {i} + {i + 7}?") for i in range(rows)]
    comps = [torch.randint(4, vocab, (completion,), generator=g).tolist() for _ in range(rows)]
    pol.model.train()
    t = time.perf_counter()
    lp = pol.logprobs(prompts, comps)
    lp.sum().backward()
    wall = time.perf_counter() - t
    chunks = -(-rows * completion * vocab // pol.logits_budget)
    return {"seconds": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "chunks": max(1, chunks), "logprobs": lp.detach()[:2].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="real:gemma3")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        budget = int(args.child) or None
        print("RESULT " + json.dumps(child(args.model, args.rows, args.completion, budget)), flush=True)
        return
    repeats = args.repeats or (1 if args.quick else 3)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    settings = {"one_chunk": str(10**12), "chunked": "0"}
    runs: dict[str, list[dict]] = {k: [] for k in settings}
    for _ in range(repeats):
        for name, budget in settings.items():
            out = subprocess.run([sys.executable, __file__, "--child", budget, "--model", args.model, "--rows",
                                  str(args.rows), "--completion", str(args.completion)],
                                 capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    res = {}
    for name, rs in runs.items():
        res[name] = {"seconds": statistics.median(r["seconds"] for r in rs), "seconds_all": [r["seconds"] for r in rs],
                     "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs), "chunks": rs[0]["chunks"]}
        print(f"{name:10s} {res[name]['chunks']:>3d} chunk(s)  {res[name]['seconds']:.2f} s  "
              f"peak RSS {res[name]['peak_rss_mb']:.0f} MB", flush=True)
    a, b = runs["one_chunk"][0]["logprobs"], runs["chunked"][0]["logprobs"]
    diff = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    mach = machine()
    mach["load_avg"] = {"start": load0, "end": os.getloadavg()[0]}
    write_result("logprob_chunks" + ("_quick" if args.quick else ""), {
        "model": args.model, "rows": args.rows, "completion_tokens": args.completion, "settings": res,
        "max_logprob_diff": diff, "peak_rss_saved_mb": res["one_chunk"]["peak_rss_mb"] - res["chunked"]["peak_rss_mb"],
        "time_ratio_chunked_over_one": res["chunked"]["seconds"] / res["one_chunk"]["seconds"],
        "machine": mach, "quick": args.quick, "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
