"""Weighing the evidence: a protocol-following comparison of sharing strategies (arms, tuning on
validation, compute matched per policy, paired intervals over fresh seeds), its records and its
report.

- :mod:`~mutualrl.study.harness`: :class:`Study` runs :class:`Arm` s on seeds (each run in its own
  process, :mod:`~mutualrl.study.one`), tunes candidates on validation and writes the study's JSON;
- :mod:`~mutualrl.study.records`: one compact record per run, what every figure is aggregated from;
  :mod:`~mutualrl.study.reuse`: when a record stands for a run; :mod:`~mutualrl.study.provenance`:
  the revision, machine and starting weights a run records;
- :mod:`~mutualrl.study.aggregate`: the figures from the records alone; :mod:`~mutualrl.study.evidence`:
  paired differences, intervals, compute spent, the peers' share;
- :mod:`~mutualrl.study.spec` and :mod:`~mutualrl.study.command`: the study file and ``mutualrl study``;
- :mod:`~mutualrl.study.report`: report.md and the figure from run directories.
"""

from mutualrl.study.aggregate import StudyError, aggregate, rewrite
from mutualrl.study.harness import ROLES, Arm, RunFailed, Study
from mutualrl.study.records import deep_merge, load_records
from mutualrl.study.spec import StudySpec, load_study

__all__ = ["ROLES", "Arm", "RunFailed", "Study", "StudyError", "StudySpec", "aggregate", "deep_merge", "load_records",
           "load_study", "rewrite"]
