"""Checkpoints of a run: atomic writes, the last good checkpoint, pruning and verification.

Layout under ``RUN_DIR/checkpoints``::

    step_000050/            one complete checkpoint (the state before step 50 runs)
        <policy>/           per policy: model.safetensors, optimizer.pt, rng.pt, state.json
        trainer_state.json  written last: next step, exchange position, manifest of every file
    LATEST                  name of the newest checkpoint (informational; see below)
    .tmp-step_000060/       a checkpoint being written (never read; removed on the next save)

A checkpoint is written into a ``.tmp-`` directory, every file and directory is fsynced, then
the directory is renamed into place (atomic on POSIX) and the parent fsynced; ``LATEST`` is
updated with temp + fsync + rename; only then are old checkpoints pruned (the newest ``keep``
survive). A crash at any moment therefore leaves the previous good checkpoint untouched.

The *last good* checkpoint is the complete one (``trainer_state.json`` present and every file of
its manifest present with its recorded size) with the highest step; ``LATEST`` is only a hint
for people, so a crash between the rename and the ``LATEST`` update loses nothing.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from mutualrl.run.faults import fault_point

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
TRAINER_STATE = "trainer_state.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the cause."""


# ----------------------------------------------------------------------------- durable files
def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically: temp file, fsync, rename, fsync the directory."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """Flush every file and directory under ``root`` to disk (before a rename publishes it)."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def publish_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory ``tmp`` to ``final`` by rename; an existing ``final`` is moved
    aside first and removed after (never a moment without one of them complete)."""
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _manifest(root: Path) -> dict[str, int]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != TRAINER_STATE:
            out[p.relative_to(root).as_posix()] = p.stat().st_size
    return out


def step_of(path: Path) -> int | None:
    """The step number of a ``step_NNNNNN`` checkpoint directory, else None."""
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- reading
def read_state(ck: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The trainer state of a checkpoint if it is complete (manifest satisfied), else None."""
    ck = Path(ck)
    try:
        state = json.loads((ck / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or "next_step" not in state:
        return None
    for rel, size in (state.get("manifest") or {}).items():
        f = ck / rel
        try:
            if f.stat().st_size != size:
                return None
        except OSError:
            return None
    return state


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        s = step_of(d)
        if s is not None and d.is_dir() and read_state(d) is not None:
            found.append((s, d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The last good checkpoint of a run directory (highest complete step), or None."""
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


def verify_checkpoint(ck: str | os.PathLike[str]) -> list[str]:
    """Problems that would stop ``ck`` from loading (empty list: it loads).

    Checks the manifest, then actually parses every file: safetensors weights, ``torch.load``
    with ``weights_only=True`` for optimizer and RNG state, JSON for the rest.
    """
    import torch
    from safetensors.torch import load_file

    ck = Path(ck)
    state = read_state(ck)
    if state is None:
        return [f"{ck}: incomplete (no valid {TRAINER_STATE} or a file differs from its manifest)"]
    problems = []
    for name in state.get("policies", []):
        d = ck / name
        try:
            load_file(str(d / MODEL_FILE))
            torch.load(d / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
            torch.load(d / RNG_FILE, weights_only=True, map_location="cpu")
            json.loads((d / STATE_FILE).read_text(encoding="utf-8"))
        except Exception as exc:  # noqa: BLE001 - report any reason it does not load
            problems.append(f"{d}: {type(exc).__name__}: {exc}")
    return problems


# ----------------------------------------------------------------------------- one policy's state
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
LEGACY_PHASE_OPTIMIZER_FILE = "optimizer_rescue.pt"
"""Where checkpoints of earlier releases kept the one extra optimizer (SGT's / imitate's rescue step)."""


def optimizer_file(phase: str) -> str:
    """The file of optimizer phase ``phase``: ``optimizer.pt`` for the policy's own, else
    ``optimizer_<phase>.pt``."""
    return OPTIMIZER_FILE if phase == "policy" else f"optimizer_{phase}.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
RANKS_FILE = "ranks.json"
"""How many data-parallel ranks wrote a policy's state (only when more than one)."""


def tied_aliases(module: Any) -> dict[str, str]:
    """State-dict keys that alias another key's storage (tied weights), mapped to the key kept.

    The first key of each storage (in state-dict order) is kept; e.g. a tied LM head maps
    ``lm_head.weight`` to ``model.embed_tokens.weight``.
    """
    first: dict[tuple[int, int], str] = {}
    out: dict[str, str] = {}
    for k, v in module.state_dict(keep_vars=True).items():
        if v.numel() == 0:
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        if key in first:
            out[k] = first[key]
        else:
            first[key] = k
    return out


def save_module(module: Any, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> list[str]:
    """Save ``module``'s state (only ``keys`` if given) as safetensors, each tied storage once.

    Returns the keys written. Tensors are copied to contiguous host memory after the aliases are
    dropped, so the file holds every distinct weight exactly once."""
    from safetensors.torch import save_file

    aliases = tied_aliases(module)
    wanted = None if keys is None else set(keys)
    state = {}
    for k, v in module.state_dict().items():
        if k in aliases or (wanted is not None and k not in wanted):
            continue
        state[k] = v.detach().to("cpu").contiguous().clone()
    save_file(state, os.fspath(path))
    return list(state)


def load_module(module: Any, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> None:
    """Load a :func:`save_module` file into ``module``, strictly: every expected key (all of the
    module's keys, or ``keys``) except tied aliases must be in the file, and nothing else may be.
    Raises :class:`CheckpointError` naming the missing or unexpected keys."""
    from safetensors.torch import load_file

    sd = load_file(os.fspath(path))
    aliases = tied_aliases(module)
    expected = set(module.state_dict()) if keys is None else set(keys)
    expected -= set(aliases)
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}); was it written for another model?")
    result = module.load_state_dict(sd, strict=False)
    left = sorted(set(result.missing_keys) - set(aliases) - (set(module.state_dict()) - expected - set(aliases)))
    if left:  # pragma: no cover - guarded by the key check above
        raise CheckpointError(f"{path}: weights not loaded for {left[:5]}")


def rank_file(name: str, rank: int) -> str:
    """A per-rank file of a policy's checkpoint: ``name`` for rank 0 (and a policy of one worker),
    ``<stem>-rank<r><suffix>`` for the others (``rng-rank1.pt``)."""
    if rank == 0:
        return name
    stem, dot, suffix = name.partition(".")
    return f"{stem}-rank{rank}{dot}{suffix}"


def save_policy_state(directory: str | os.PathLike[str], policy: Any, extra: dict[str, Any], rank: int = 0,
                      world: int = 1) -> None:
    """Write one policy's resumable state into ``directory``: its trainable weights (every weight,
    or only the adapter with LoRA), optimizer state, RNG states (its sampling generator, torch's,
    Python's and NumPy's) and ``extra`` (JSON-able counters).

    A policy on several data-parallel ranks: every rank holds the same weights and optimizer state,
    so rank 0 alone writes them; each rank writes its own RNG states and counters
    (:func:`rank_file`), so that a resumed rank samples what it would have sampled. Under FSDP
    (:mod:`mutualrl.run.fsdp`) every rank takes part in gathering the weights and optimizer states
    first, and rank 0 writes them in the same format."""
    import torch

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fsdp = getattr(policy, "fsdp", None)
    if fsdp is not None:  # collectives: every rank, the same order
        fsdp.gather()
    optim = {phase: fsdp.full_optimizer_state(opt, keep=rank == 0) if fsdp is not None else opt.state_dict()
             for phase, opt in policy.optimizers.items()}
    if rank == 0:
        if world > 1:
            (d / RANKS_FILE).write_text(json.dumps({"world": world}), encoding="utf-8")
        save_module(getattr(policy, "full_weights", policy.model), d / MODEL_FILE, policy.checkpoint_keys())
        for phase, sd in optim.items():
            torch.save(sd, d / optimizer_file(phase))
    torch.save({"generator": policy.generator.get_state(), "torch": torch.get_rng_state()},
               d / rank_file(RNG_FILE, rank))
    state = {"python_random": _py_random_state(), "numpy_random": _np_random_state(), **extra}
    (d / rank_file(STATE_FILE, rank)).write_text(json.dumps(state), encoding="utf-8")


def load_policy_state(directory: str | os.PathLike[str], policy: Any, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Restore what :func:`save_policy_state` wrote (RNG states included, ``rank``'s own); returns its
    ``extra``. A checkpoint written by another number of ranks is refused (:class:`CheckpointError`):
    the ranks' sampling states and counters would not continue."""
    import torch

    d = Path(directory)
    written = json.loads((d / RANKS_FILE).read_text(encoding="utf-8"))["world"] if (d / RANKS_FILE).is_file() else 1
    if int(written) != world:
        raise CheckpointError(f"{d}: written by {written} rank(s) of this policy, resumed with {world}: set the "
                              f"policy's workers to {written} to resume it (a workers: auto plan may differ on "
                              "other hardware)")
    fsdp = getattr(policy, "fsdp", None)
    load_module(getattr(policy, "full_weights", policy.model), d / MODEL_FILE, policy.checkpoint_keys())
    if fsdp is not None:  # each rank keeps its shard of what it read
        fsdp.scatter()
    extra = [ph for ph in policy.optimizers if ph != "policy"]
    for phase, opt in policy.optimizers.items():
        path = d / optimizer_file(phase)
        if not path.is_file() and len(extra) == 1 and phase == extra[0] and (d / LEGACY_PHASE_OPTIMIZER_FILE).is_file():
            path = d / LEGACY_PHASE_OPTIMIZER_FILE  # a checkpoint of an earlier release
        if not path.is_file():
            raise CheckpointError(f"{path}: missing: the checkpoint holds no state of optimizer phase {phase!r} "
                                  "(was it written by a run with another sharing strategy?)")
        # read onto the host whatever device wrote it (a GPU the reader may not have, or see under
        # another number); load_state_dict moves each state to its parameter's device
        sd = torch.load(path, weights_only=True, map_location="cpu")
        opt.load_state_dict(fsdp.local_optimizer_state(opt, sd) if fsdp is not None else sd)
    rng = torch.load(d / rank_file(RNG_FILE, rank), weights_only=True, map_location="cpu")
    policy.generator.set_state(rng["generator"])
    torch.set_rng_state(rng["torch"])
    state = json.loads((d / rank_file(STATE_FILE, rank)).read_text(encoding="utf-8"))
    _set_py_random_state(state.pop("python_random"))
    _set_np_random_state(state.pop("numpy_random"))
    return state


def _py_random_state() -> list:
    s = random.getstate()
    return [s[0], list(s[1]), s[2]]


def _set_py_random_state(s: list) -> None:
    random.setstate((s[0], tuple(s[1]), s[2]))


def _np_random_state() -> dict:
    st = np.random.get_state()
    return {"keys": st[1].tolist(), "pos": int(st[2]), "has_gauss": int(st[3]), "cached": float(st[4])}


def _set_np_random_state(s: dict) -> None:
    np.random.set_state(("MT19937", np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached"]))




# ----------------------------------------------------------------------------- writing
class CheckpointManager:
    """Writes, finds and prunes the checkpoints of one run directory.

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        keep: how many complete checkpoints to keep (the newest ones); at least 1.
    """

    def __init__(self, run_dir: str | os.PathLike[str], keep: int = 2) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.keep = max(1, int(keep))

    def latest(self) -> Path | None:
        """The last good checkpoint, or None."""
        return latest_checkpoint(self.run_dir)

    def clean_partial(self) -> None:
        """Remove leftovers of interrupted saves (``.tmp-*`` / ``.NAME.old-*`` directories)."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.name.startswith((".tmp-", ".old-")) or (d.name.startswith(".") and ".old-" in d.name):
                shutil.rmtree(d, ignore_errors=True)
            elif d.name.startswith(f".{LATEST}.tmp-"):
                d.unlink(missing_ok=True)

    def save(self, step: int, write_policies: Callable[[Path], list[str]], state: dict[str, Any]) -> Path:
        """Write the checkpoint ``step_<step>`` atomically and prune old ones.

        ``write_policies(tmp_dir)`` writes every policy's files under ``tmp_dir`` and returns the
        policy names; ``state`` (JSON-able) is stored in ``trainer_state.json`` together with
        ``next_step``, the manifest and the format version. Raises :class:`CheckpointError` (the
        previous checkpoints untouched) when anything fails, e.g. a full disk.
        """
        name = f"step_{step:06d}"
        tmp = self.root / f".tmp-{name}"
        final = self.root / name
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.clean_partial()
            tmp.mkdir()
            policies = write_policies(tmp)
            fault_point("checkpoint_write")
            full = {**state, "format": FORMAT_VERSION, "next_step": int(step), "policies": list(policies),
                    "time": time.time(), "manifest": _manifest(tmp)}
            with open(tmp / TRAINER_STATE, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(full, indent=1))
            fsync_tree(tmp)
            publish_dir(tmp, final)  # an existing one: the same step written again (a run extended with --steps)
            fsync_dir(self.root)
            fault_point("checkpoint_commit")
            atomic_write_text(self.root / LATEST, name + "\n")
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            last = self.latest()
            full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or \
                "space left" in str(exc).lower()
            why = "the disk is full" if full else f"{type(exc).__name__}: {exc}"
            raise CheckpointError(
                f"could not write checkpoint {final}: {why}; last good checkpoint: {last if last else 'none'} "
                f"(intact). Free space, then resume with: mutualrl train --resume {self.run_dir}") from exc
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep`` complete checkpoints; return what was deleted."""
        cks = list_checkpoints(self.run_dir)
        gone = cks[: max(0, len(cks) - self.keep)]
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)
        # incomplete step_ directories (never the case with this writer, but be tidy)
        if self.root.is_dir():
            complete = set(cks)
            for d in self.root.iterdir():
                if step_of(d) is not None and d.is_dir() and d not in complete:
                    newest = cks[-1] if cks else None
                    if newest is not None and step_of(d) < step_of(newest):  # type: ignore[operator]
                        shutil.rmtree(d, ignore_errors=True)
        return gone
