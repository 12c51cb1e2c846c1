"""A zoo warm start's validation curve under a changed spec (the learning rate, say), without a
stall rule, printing every 100 steps: what ``zoo_builds.py`` needs when a build does not land.

    python benchmarks/zoo_lr_probe.py POLICY SEED CAP [CHANGES_JSON] [--out FILE]

Builds ``POLICY`` (a default zoo spec with ``CHANGES_JSON`` applied, e.g. ``'{"lr": 0.001}'``) at build
seed ``SEED`` on one torch thread, the generalist phase capped at ``CAP`` steps and the specialisation
at 1,500, stall checks off; prints each check on a hundred-step boundary (and every specialising
check) and writes the whole validation history as JSON to ``--out`` (default
``benchmarks/results/zoo_lr_probe/<policy>-seed<seed>-<changes>.json``). Nothing is cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from _common import RESULTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy")
    ap.add_argument("seed", type=int)
    ap.add_argument("cap", type=int)
    ap.add_argument("changes", nargs="?", default="{}")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    from mutualrl.zoo.build import corpus
    from mutualrl.zoo.models import build_model
    from mutualrl.zoo.sft import sft
    from mutualrl.zoo.specs import ZOO
    from mutualrl.zoo.task import build_task_for_seed
    from mutualrl.zoo.tokenizers import train_tokenizer

    torch.set_num_threads(1)
    changes = json.loads(args.changes)
    spec = dataclasses.replace(ZOO[args.policy], generalist_max_steps=args.cap, sft_max_steps=1500, stall_checks=0,
                               stall_patience=0, **changes)
    task = build_task_for_seed(args.seed)
    tok = train_tokenizer(spec.tokenizer, corpus(task), spec.vocab_size)
    torch.manual_seed(args.seed)
    model = build_model(spec, tok)
    t0 = time.perf_counter()

    def on_step(_: int, loss: float, check: dict | None) -> None:
        if check is not None and (check["step"] % 100 == 0 or check.get("phase") == "specialise"):
            print(f"{changes} seed {args.seed} step {check['step']} {check.get('phase')} loss {loss:.3f} "
                  f"val {check['val']} t {time.perf_counter() - t0:.0f}s", flush=True)

    res = sft(model, tok, task, spec, args.seed, on_step)
    tag = "-".join(f"{k}{v}" for k, v in changes.items()) or "spec"
    out = args.out or RESULTS / "zoo_lr_probe" / f"{args.policy}-seed{args.seed}-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"policy": args.policy, "seed": args.seed, "changes": changes, "landed": res.landed,
                               "phase_steps": res.phase_steps, "gave_up": res.gave_up,
                               "wall_s": time.perf_counter() - t0, "history": res.history}, indent=1) + "\n")
    print(f"landed {res.landed} phase steps {res.phase_steps} -> {out}")


if __name__ == "__main__":
    main()
