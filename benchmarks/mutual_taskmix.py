"""The sharing study on a second task mix: a 3- or 4-digit number multiplied by 3, and by 4 (no
addition or subtraction), policies built with ``mutualrl zoo build --task examples/zoo_taskmix.yaml``
(under two minutes a build), **each run on the zoo build of its own seed**: seeds vary the warm starts
as well as the prompts and the sampling.

    python benchmarks/mutual_taskmix.py [--jobs 2] [--reuse] [--final-seeds 0,1,2,3,4] [--phase tune|headline|all] [--own-replay]

The protocol and arms of ``benchmarks/mutual.py`` (tuned on validation, compute-matched control,
efficiency arm, test read once, paired intervals) on the task file's policies (``gpt2-x3``: GPT-2,
byte-level BPE, specialised in times 3; ``llama-x4``: Llama, Unigram, in times 4). Writes
``benchmarks/results/mutual_taskmix.json``, ``mutual_taskmix_runs/`` and ``mutual_taskmix_report/``.
"""

from __future__ import annotations

from pathlib import Path

import mutual

TASK_FILE = str(Path(__file__).resolve().parent.parent / "examples" / "zoo_taskmix.yaml")

if __name__ == "__main__":
    ap = mutual.parser("mutual_taskmix", "runs/study_mutual_taskmix")
    ap.set_defaults(task_file=TASK_FILE, zoo_seed_follows_seed=True)
    mutual.run(ap.parse_args())
