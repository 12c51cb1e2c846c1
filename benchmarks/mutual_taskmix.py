"""The sharing study on a second task mix: a 3- or 4-digit number multiplied by 3, and by 4 (no
addition or subtraction), policies built with ``mutualrl zoo build --task examples/zoo_taskmix.yaml``
(under two minutes a build), **each run on the zoo build of its own seed**: seeds vary the warm starts
as well as the prompts and the sampling.

    python benchmarks/mutual_taskmix.py [--jobs 2] [--final-seeds 1,...,17] [--phase tune|all]

The pre-registered plan and arms of ``benchmarks/mutual.py`` (tuned on validation with equal
candidates a side, the control matched per policy and seed, a fresh test split read once, paired
intervals; the first protocol's tuning records reused from ``mutual_taskmix_protocol1``) on the task
file's policies (``gpt2-x3``: GPT-2,
byte-level BPE, specialised in times 3; ``llama-x4``: Llama, Unigram, in times 4). Writes
``benchmarks/results/mutual_taskmix.json``, ``mutual_taskmix_runs/`` and ``mutual_taskmix_report/``.
"""

from __future__ import annotations

from pathlib import Path

import mutual

TASK_FILE = str(Path(__file__).resolve().parent.parent / "examples" / "zoo_taskmix.yaml")

if __name__ == "__main__":
    ap = mutual.parser("mutual_taskmix", "runs/study_mutual_taskmix", reuse_from="mutual_taskmix_protocol1")
    ap.set_defaults(task_file=TASK_FILE, final_seeds=",".join(str(s) for s in range(1, 18)), target=3.0)
    mutual.run(ap.parse_args())
