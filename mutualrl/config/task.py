"""The ``task:`` section of a run config: the datasets the policies train on, the splits, the prompt
stream, how answers are read and scored, and the checks that need nothing but the section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mutualrl.config.schema import Freezable, bounded, check_bounds
from mutualrl.errors import ConfigError


@dataclass
class DatasetConfig(Freezable):
    """One task source: a reasoning-gym dataset (``name``), a user file (``path``) or a Hugging Face
    dataset (``dataset``)."""

    name: str | None = None
    """reasoning-gym dataset name, e.g. ``basic_arithmetic`` (see ``mutualrl tasks list``)."""
    path: str | None = None
    """A ``.jsonl`` or ``.parquet`` file with question/answer columns."""
    dataset: str | None = None
    """A Hugging Face dataset: a ``save_to_disk`` directory, or a hub id (``openai/gsm8k``; loading it
    needs the network). In Python, ``MutualTrainer(config, train_dataset=ds)`` takes a ``Dataset``."""
    alias: str | None = None
    """Short name used in problem ids and per-type metrics (defaults to the dataset/file name)."""
    weight: float = bounded(1.0, gt=0)
    config: dict[str, Any] = field(default_factory=dict)
    """Options of the reasoning-gym dataset's config dataclass."""
    split: str = "train"
    """``dataset``: the split to train on (of a ``DatasetDict``)."""
    test_split: str | None = None
    """``dataset``: the split to evaluate on (e.g. ``test``); none: a held-out ``test_fraction`` of ``split``."""
    question_field: str | None = None
    """The question column (default: the first of question, prompt, problem, messages); a conversational
    value (a list of chat messages) contributes its last user turn."""
    answer_field: str | None = None
    """The gold answer column (default: answer, else solution)."""
    answer_extractor: str = "raw"
    """How the gold answer is cut out of ``answer_field``: ``raw``, ``####`` (GSM8K), ``boxed``,
    ``last_number`` or ``regex:<pattern>`` (any answer extraction mode)."""
    verifier: Literal["exact", "math"] = "exact"
    """``exact``: normalised text or number; ``math``: equivalence by math-verify (LaTeX, fractions,
    decimals, sets, ...). Files and datasets only (reasoning-gym brings its own)."""
    test_fraction: float = bounded(0.2, gt=0, lt=1)


@dataclass
class TaskConfig(Freezable):
    """The ``task`` section: the datasets the policies train on, how many problems are drawn for
    training and held out for validation and testing (disjoint, by ``seed``), the prompt stream
    (``prompt_seed``), and how an answer is read and scored."""

    datasets: list[DatasetConfig] = field(default_factory=list)
    test_size: int = bounded(1000, ge=1)
    train_size: int = bounded(20000, ge=1)
    val_size: int = bounded(0, ge=0)
    """Problems held out of training as a validation split (disjoint from train and test; shared
    between the sources by weight). With one, the periodic evaluations read validation and the test
    split is read once, at the end of the run: choices (hyperparameters, which arm, early stops) are
    made on validation, the test figure is reported as it is. 0: no validation split (the periodic
    evaluations read test)."""
    seed: int = 0
    """Seed of the splits: which problems are train, validation and test."""
    heldout_seed: int | None = None
    """Draw a fresh test split with this seed from problems none of the ``seed`` splits holds (its
    train, validation and test lists): a test no run or warm start on those splits has read. Training
    keeps the ``seed`` training list. None: the ``seed`` test split."""
    val_like_test: bool = False
    """With ``heldout_seed`` and ``val_size``: draw validation with the fresh test from one pool, cut
    at random per source, so validation is distributed like test (instead of the training list's tail,
    which can lack what the test draw used up of a small problem space)."""
    prompt_seed: int | None = None
    """Seed of the training prompt stream (which training problems each step draws); none: the
    run's ``seed``, so runs of different seeds see different prompts on the same splits."""
    answer_extraction: str = "first_line"
    """``first_line``, ``last_number``, ``first_number``, ``boxed``, ``raw`` or ``regex:<pattern>``."""
    reward_functions: list[str] = field(default_factory=list)
    """Extra TRL-style reward functions by import path ``package.module:function``."""
    reward_timeout_s: float = bounded(10.0, gt=0)
    reward: Literal["score", "exact"] = "exact"
    """``score``: the verifier's score is the reward (reasoning-gym gives partial credit, e.g. 0.67
    for ``570`` when the answer is ``57``); ``exact``: 1 for a success, else 0."""
    preset: str | None = None
    """``zoo`` = the embedded default task (addition + subtraction); replaces ``datasets``."""



# ----------------------------------------------------------------------------- checks of the section alone
def check_task(t: TaskConfig) -> None:
    """The checks of a ``task:`` section that need nothing but the section (the resolver checks
    the rest: datasets exist, files read, reward functions import)."""
    check_bounds(t, "task")
    if t.preset not in (None, "zoo"):
        raise ConfigError("task.preset", f"expected 'zoo' or nothing, got {t.preset!r}")
    if t.heldout_seed is not None and (isinstance(t.heldout_seed, bool) or not isinstance(t.heldout_seed, int)
                                       or t.heldout_seed < 0 or t.heldout_seed == t.seed):
        raise ConfigError("task.heldout_seed", f"expected a seed (an integer >= 0) other than task.seed "
                          f"({t.seed}), got {t.heldout_seed!r}")
    if t.val_like_test and (t.heldout_seed is None or not t.val_size):
        raise ConfigError("task.val_like_test", "draws validation with the fresh test split: set task.heldout_seed "
                          "and task.val_size too, or val_like_test: false")
    if t.preset is None and not t.datasets:
        raise ConfigError("task.datasets", "give at least one dataset (name: <reasoning-gym dataset> or path: FILE), "
                          "or set task.preset: zoo")
    for i, d in enumerate(t.datasets):
        if sum(x is not None for x in (d.name, d.path, d.dataset)) != 1:
            raise ConfigError(f"task.datasets[{i}]", "give exactly one of 'name' (reasoning-gym dataset), 'path' "
                              "(JSONL/Parquet file) or 'dataset' (Hugging Face dataset: directory or hub id)")
