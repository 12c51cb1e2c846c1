"""Building zoo policies: tokenizer, model, banded warm start, card, atomic write into the cache.

Built policies are ordinary Hugging Face directories (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) plus ``zoo_card.json``
(spec, size, tokenizer, where SFT landed, measured accuracies). They live under
``<cache>/zoo/<hash>/<name>``, the hash covering the spec, the build seed, the task and
:data:`~mutualrl.zoo.specs.ZOO_VERSION`, so a second run loads in seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from mutualrl.denormals import denormals_kept
from mutualrl.paths import cache_root as _cache_root
from mutualrl.run.progress import Progress
from mutualrl.run.quiet import quiet_transformers
from mutualrl.zoo.evaluate import evaluate
from mutualrl.zoo.models import build_model
from mutualrl.zoo.parallel import build_in_processes
from mutualrl.zoo.sft import SFTResult, ZooBandError, band_failure, sft
from mutualrl.zoo.shipped import shipped_built_with, shipped_key, shipped_version, verified_dir
from mutualrl.zoo.specs import DEFAULT_NAMES, ZOO, ZOO_VERSION, ZooSpec, check_names
from mutualrl.zoo.stall import init_seed
from mutualrl.zoo.steps import check_task_size
from mutualrl.zoo.task import PROMPT_TEMPLATE, SPLIT_SEED, build_task_for_seed, format_prompt


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where built zoo policies live: ``cache_dir``, else ``<mutualrl cache>/zoo``."""
    return Path(cache_dir).expanduser() if cache_dir is not None else _cache_root("zoo")


def task_key(task: Any | None) -> str:
    """A short hash of a task's sources (empty for the default zoo task)."""
    if task is None:
        return ""
    desc = [[getattr(s, "dataset", type(s).__name__), s.name, getattr(s, "config", {}), _data_hash(s)]
            for s in task.sources]
    payload = json.dumps({"sources": desc, "weights": task.weights, "seed": task.seed}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def is_shipped(name: str, seed: int = 0, spec: ZooSpec | None = None, task: Any | None = None) -> bool:
    """Whether ``name`` at build ``seed`` for ``task`` is one of the shipped, prebuilt policies
    (:mod:`mutualrl.zoo.shipped`): the default spec, build seed 0, the zoo task (the key is the one of
    the :data:`~mutualrl.zoo.specs.ZOO_VERSION` they were built under; a field the default recipe
    changed since counts at the value the shipped build used: :func:`~mutualrl.zoo.shipped.shipped_built_with`)."""
    spec = spec if spec is not None else ZOO.get(name)
    version = shipped_version(name)
    if spec is None or task is not None or seed != 0 or version is None:
        return False
    default = ZOO.get(name)
    then = {k: v for k, v in shipped_built_with(name).items()
            if default is not None and getattr(spec, k) == getattr(default, k)}
    return shipped_key(name) == dataclasses.replace(spec, **then).cache_key(seed, task_key(task), version=version)


def _zoo_task_key(seed: int) -> str:
    """The cache key part of the zoo task for build ``seed``: empty for seed 0 (the shipped builds'
    key), else a mark that the build trained on the fixed seed-0 splits (:data:`SPLIT_SEED`): builds
    of other seeds from before that fix trained on their own seed's splits and are not reused."""
    return "" if seed == SPLIT_SEED else f"splits{SPLIT_SEED}"


def _data_hash(source: Any) -> str:
    """A file source's data by content (where the file lies does not change the task), else ''."""
    path = getattr(source, "path", None)
    if path is None or not Path(path).is_file():
        return ""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def policy_dir(name: str, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None,
               spec: ZooSpec | None = None, task: Any | None = None, *, shipped: bool = True) -> Path:
    """The model directory of zoo policy ``name`` for build ``seed``: the shipped one (hash-checked)
    where it applies and ``shipped`` is true, else its cache directory (it may not be built yet)."""
    if spec is None:
        check_names([name])
        spec = ZOO[name]
    if shipped and is_shipped(name, seed, spec, task):
        return verified_dir(name)
    return cache_root(cache_dir) / spec.cache_key(seed, task_key(task) if task is not None else _zoo_task_key(seed)) / name


def is_built(path: Path) -> bool:
    return (path / "zoo_card.json").is_file() and (path / "model.safetensors").is_file()


def load_card(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``zoo_card.json`` of a built zoo policy directory."""
    return json.loads((Path(path) / "zoo_card.json").read_text())


def corpus(task: Any, limit: int = 4000) -> list[str]:
    """Tokenizer training text: training prompts with their answers, all task types, an evenly
    strided subset of at most ``limit`` (the text is very regular; more only costs time)."""
    texts = [format_prompt(p.question) + p.answer for k in task.train for p in task.train[k]]
    return texts[:: max(1, math.ceil(len(texts) / limit))]


def weights_hash(model: Any) -> str:
    """sha256 (16 hex chars) over a model's state dict, keys and bytes in key order."""
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(spec: ZooSpec, seed: int, task: Any, tokenizer: Any, on_step: Callable[..., None] | None = None,
          on_phase: Callable[[str, int, int, int, int], None] | None = None
          ) -> tuple[Any, SFTResult, list[dict[str, Any]]]:
    """A fresh model of ``spec`` warm-started on ``task`` (:func:`~mutualrl.zoo.sft.sft`); after a
    stall, again from another initialisation (:func:`~mutualrl.zoo.stall.init_seed`), at most
    ``spec.stall_restarts`` times. Returns the last model, its result and a record per attempt
    (``attempt``, ``init_seed``, ``steps``, ``landed``, ``stall``, ``gave_up``). ``on_phase(phase,
    cap, done, attempt, init_seed)`` is told when each phase of each attempt starts."""
    attempts: list[dict[str, Any]] = []
    for attempt in range(spec.stall_restarts + 1):
        init = init_seed(seed, attempt)
        torch.manual_seed(init)  # attempt 0: the build seed, as always
        model = build_model(spec, tokenizer)

        def phase(name: str, cap: int, done: int, a: int = attempt, i: int = init) -> None:
            if on_phase is not None:
                on_phase(name, cap, done, a, i)

        res = sft(model, tokenizer, task, spec, init, on_step, phase)
        attempts.append({"attempt": attempt, "init_seed": init, "steps": len(res.losses), "landed": res.landed,
                         "phase_steps": dict(res.phase_steps), "stall": res.stall.to_dict() if res.stall else None,
                         "gave_up": res.gave_up})
        if res.stall is None:
            break
    return model, res, attempts


def build_one(spec: ZooSpec, seed: int, task: Any, target: Path,
              on_step: Callable[[int, float, dict[str, Any] | None], None] | None = None,
              on_phase: Callable[[str, int, int, int, int], None] | None = None) -> dict[str, Any]:
    """Build ``spec`` for ``task`` into ``target`` (atomically); return its card.

    Raises :class:`~mutualrl.zoo.sft.ZooBandError` (exit code 2 from the CLI) when SFT did not
    land in the band, a stall included (after its restarts); nothing is written then."""

    from mutualrl.zoo.tokenizers import tokenizer_model_type, train_tokenizer

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(spec.tokenizer, corpus(task), spec.vocab_size)
    model, res, attempts = train(spec, seed, task, tokenizer, on_step, on_phase)
    if not res.landed:
        raise band_failure(spec, res, attempts)
    t_sft = time.perf_counter() - t0
    greedy = evaluate(model, tokenizer, task, temperature=0.0, seed=seed)
    sampled = evaluate(model, tokenizer, task, temperature=1.0, seed=seed)
    k = max(1, len(res.losses) // 20)
    card = {
        "name": spec.name, "seed": seed, "zoo_version": ZOO_VERSION, "spec": spec.to_dict(),
        "task_key": task_key(task) if task is not None else "",
        "model_type": model.config.model_type, "architecture": type(model).__name__,
        "n_params": sum(p.numel() for p in model.parameters()), "tokenizer_kind": spec.tokenizer,
        "tokenizer_model": tokenizer_model_type(tokenizer), "vocab_size": len(tokenizer),
        "special_tokens": {"pad": [tokenizer.pad_token, tokenizer.pad_token_id],
                           "bos": [tokenizer.bos_token, tokenizer.bos_token_id],
                           "eos": [tokenizer.eos_token, tokenizer.eos_token_id],
                           "unk": [tokenizer.unk_token, tokenizer.unk_token_id]},
        "prompt_template": PROMPT_TEMPLATE, "torch_threads": torch.get_num_threads(),
        "bands": {k2: list(v) for k2, v in spec.bands.items()},
        "landed_val_accuracy": res.val_accuracy, "sft_steps_done": len(res.losses), "sft_val_history": res.history,
        "sft_steering": res.steering, "sft_mixture_final": res.mixture, "sft_lr_scale_final": res.lr_scale,
        "sft_phase_steps": res.phase_steps, "init_seed": attempts[-1]["init_seed"], "attempts": attempts,
        "sft_steps_all_attempts": sum(a["steps"] for a in attempts), "sft_check_s": round(res.check_s, 1),
        "sft_loss_first": sum(res.losses[:k]) / k, "sft_loss_last": sum(res.losses[-k:]) / k,
        "accuracy_greedy": greedy, "accuracy_sampled_t1": sampled,
        "n_test_per_type": {name: len(p) for name, p in task.test.items()},
        "weights_sha256": weights_hash(model),
        "build_s": round(time.perf_counter() - t0, 1), "sft_s": round(t_sft, 1),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=target.parent))
    try:
        with quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        (tmp / "zoo_card.json").write_text(json.dumps(card, indent=2) + "\n")
        if target.exists() and not is_built(target):  # a broken copy (not ours): replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: keep its copy
            if not is_built(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return card


def _phases(spec: ZooSpec) -> list[tuple[str, int]]:
    """The phases of ``spec``'s warm start and their step caps."""
    if spec.generalist_target > 0:
        return [("generalist", spec.generalist_max_steps), ("specialise", spec.sft_max_steps)]
    return [("banded", spec.sft_max_steps)]


def build_with_progress(spec: ZooSpec, seed: int, task: Any, target: Path, *, progress: bool = True,
                        stream: IO[str] | None = None, every: int | None = None) -> dict[str, Any]:
    """:func:`build_one` with a progress display (a bar on a terminal, plain lines every ``every``
    steps otherwise, default ``4 x sft_eval_every``) and a closing line with where it landed, or
    why it stopped; returns the card.

    The display follows the phase being run (``zoo gpt2-add generalist 1200/6000 (20%) | ... |
    phase 1/2``): its total is the phase's step cap, its count and ETA (an upper bound: the phase
    ends once its skills reach their goal) come from the phase's own steps, and a restart from
    another initialisation starts the phases over, named as such. The count never passes the total."""
    phases = _phases(spec)
    names = [p for p, _ in phases]
    with Progress(f"zoo {spec.name} {phases[0][0]}", phases[0][1], enabled=progress, stream=stream, bound=True,
                  every=every or spec.sft_eval_every * 4) as bar:
        state: dict[str, Any] = {"offset": 0, "label": ""}

        def phase(name: str, cap: int, done: int, attempt: int, init: int) -> None:
            again = f" (restart {attempt}, init seed {init})" if attempt else ""
            bar.begin(f"zoo {spec.name} {name}{again}", cap)
            state["offset"], state["label"] = done, f"phase {names.index(name) + 1}/{len(names)}"
            bar.note = state["label"]

        def tick(step: int, loss: float, check: dict[str, Any] | None) -> None:
            if check is not None:
                bar.note = state["label"] + " | val " + " ".join(f"{k} {v:.0%}" for k, v in check["val"].items())
            bar.update(step + 1 - state["offset"], f"loss {loss:.3f}")

        try:
            card = build_one(spec, seed, task, target, tick, phase)
        except ZooBandError as exc:  # said at once (a child's stdout is relayed as it comes)
            bar.finish(f"stopped: {exc}")
            raise
        bar.finish(f"landed at step {card['sft_steps_done']}: greedy test "
                   + ", ".join(f"{k} {v:.1%}" for k, v in card["accuracy_greedy"].items()))
    return card


def build_zoo(names: Sequence[str] | None = None, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None,
              progress: bool = True, specs: dict[str, ZooSpec] | None = None, task: Any | None = None,
              threads: int | None = None, jobs: int | None = None, shipped: bool = True,
              task_section: dict[str, Any] | None = None) -> dict[str, Path]:
    """Build (or load from the cache) zoo policies and return their model directories.

    The default policies at build seed 0 on the zoo task are shipped prebuilt (hash-checked, the
    same on every machine: :mod:`mutualrl.zoo.shipped`) and never built here unless ``shipped``
    is false (``mutualrl zoo build --rebuild``).

    ``names`` defaults to :data:`~mutualrl.zoo.specs.DEFAULT_NAMES`; ``specs`` overrides the table
    (tests use tiny variants, ``zoo build --task`` the user's mixtures); ``task`` defaults to the
    zoo task. Each policy is trained with ``threads`` torch threads (default 1: the thread count
    changes floating-point rounding and with it where a tiny model's sudden skill onset falls; the
    default builds are measured to land in their bands on one thread), deterministic in ``seed``,
    and written atomically (temporary directory + rename). On the zoo task, up to ``jobs`` policies
    (default: one per core) build at once, each in its own process
    (:mod:`mutualrl.zoo.parallel`), with the same weights as one after another in this process; a
    ``task`` of the caller's builds that way too when ``task_section`` (the run config ``task:``
    section it was built from) is given, else here one after another, as ``jobs=1`` does. A
    ``task`` type with too few training problems raises
    :class:`~mutualrl.zoo.sft.TooFewProblems` (a ``ValueError``) before anything is built.
    """
    table = ZOO if specs is None else specs
    names = list(DEFAULT_NAMES if names is None else names)
    check_names(names, table)
    dirs = {n: policy_dir(n, seed, cache_dir, table[n], task, shipped=shipped) for n in names}
    todo = [n for n in names if not is_built(dirs[n])]
    if not todo:
        return dirs
    if task is not None:
        check_task_size(task)  # TooFewProblems (a ValueError) before anything is trained or written
    n_jobs = min(len(todo), jobs if jobs is not None else max(1, (os.cpu_count() or 1) // (threads or 1)))
    if (task is None or task_section is not None) and n_jobs > 1:
        for i in range(0, len(todo), n_jobs):
            build_in_processes([(table[n], dirs[n]) for n in todo[i:i + n_jobs]], seed, threads=threads or 1,
                               progress=progress, task_section=task_section)
        return dirs
    build_task = task if task is not None else build_task_for_seed(seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or 1)
    try:
        with denormals_kept():  # the same weights whether or not a run flushed them in this process
            for n in todo:
                build_with_progress(table[n], seed, build_task, dirs[n], progress=progress)
    finally:
        torch.set_num_threads(before)
    return dirs


def zoo_model_dir(name: str, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None,
                  progress: bool | None = None) -> Path:
    """The model directory of zoo policy ``name`` (``model: zoo:<name>``), built on demand."""
    check_names([name])
    if progress is None:
        progress = sys.stderr.isatty()
    return build_zoo([name], seed=seed, cache_dir=cache_dir, progress=progress)[name]
