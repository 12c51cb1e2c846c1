"""The sharing study on a second task mix: a 3- or 4-digit number multiplied by 3, and by 4 (no
addition or subtraction), policies built with ``mutualrl zoo build --task examples/zoo_taskmix.yaml``
(the study builds them first if they are not in the cache: under two minutes).

    python benchmarks/mutual_taskmix.py [--seeds 0,1,2] [--arms ...] [--steps N] [--jobs 2] [--reuse] [--zoo-seed N]

The same study as ``benchmarks/mutual.py`` (same settings, equal rollout budget, 3 seeds) on the
task file's policies (``gpt2-x3``: GPT-2, byte-level BPE, specialised in times 3; ``llama-x4``:
Llama, Unigram, in times 4; both generalists first). Writes
``benchmarks/results/mutual_taskmix.json`` and ``mutual_taskmix_report/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mutual

TASK_FILE = str(Path(__file__).resolve().parent.parent / "examples" / "zoo_taskmix.yaml")
DEFAULTS = ["--task-file", TASK_FILE, "--name", "mutual_taskmix", "--out", "runs/bench_mutual_taskmix",
            "--arms", "independent,sgt,self_imitate,prp,xgrpo,imitate,imitate+prp", "--target-gap", "3"]

if __name__ == "__main__":
    given = sys.argv[1:]
    sys.argv = [sys.argv[0]] + [a for i, a in enumerate(DEFAULTS) if not (i % 2 == 0 and a in given)
                                and not (i % 2 == 1 and DEFAULTS[i - 1] in given)] + given
    mutual.main()
