"""Trained policies out of a run: Hugging Face model directories (``mutualrl export``, TRL's ``save_model``).

A checkpoint holds what resuming needs (``checkpoints/step_N/<policy>/model.safetensors`` with
optimizer and RNG state; under LoRA only the adapter). Exporting turns one policy of one checkpoint
into a directory that ``transformers`` and vLLM read as it is:

* full fine-tuning (or ``merge_lora``): ``config.json``, ``model.safetensors``,
  ``generation_config.json`` (its ``eos_token_id``: every id the policy stopped on in training),
  the tokenizer files with the chat template; ``AutoModelForCausalLM.from_pretrained(dir)``;
* LoRA: a peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) with the
  same tokenizer and generation files; ``PeftModel.from_pretrained(base, dir)``, or
  ``AutoModelForCausalLM.from_pretrained(dir)`` where its base is at hand;

plus the model card ``README.md`` (:mod:`mutualrl.export.modelcard`) and :data:`EXPORT_INFO` (which run,
policy and step it is: ``mutualrl eval --model DIR`` reads the policy's name from it).

A checkpoint is checked before anything is loaded: its ``trainer_state.json`` must exist, be of this
code's checkpoint format (:data:`~mutualrl.run.checkpoint.FORMAT_VERSION`) and every file of its
manifest must be there with its recorded size; the weights must load strictly into the policy's
model. Anything else is refused with :class:`ExportError` (exit 2) naming the file. Each directory
is written into a temporary sibling and renamed into place, so an interrupted export leaves no
half-written model under the final name. Weights are exported in ``float32`` (the training's
master weights) unless ``dtype`` says ``bfloat16`` or ``float16``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mutualrl import __version__
from mutualrl.config.modelref import resolve_model_path
from mutualrl.errors import UserError
from mutualrl.export.hub import HubPushError, check_repo_ids, push_to_hub
from mutualrl.export.modelcard import card_facts, render_card
from mutualrl.paths import RUN_CONFIG
from mutualrl.run.checkpoint import (
    CHECKPOINTS,
    FORMAT_VERSION,
    MODEL_FILE,
    TRAINER_STATE,
    CheckpointError,
    fsync_dir,
    fsync_tree,
    load_module,
    publish_dir,
    step_of,
)
from mutualrl.run.quiet import quiet_transformers
from mutualrl.thl.peer import stop_ids_of

EXPORT_DIR = "export"
"""Where ``mutualrl export RUN_DIR`` writes without ``-o``: ``RUN_DIR/export/<policy>``."""
FINAL_DIR = "final"
"""Where a run with ``save_final_model: true`` writes its final models: ``RUN_DIR/final/<policy>``."""
EXPORT_INFO = "mutualrl_export.json"
"""What an exported directory is: run, policy, step, kind, dtype, model reference, mutualrl version."""
EXPORT_FORMAT = 1
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
KINDS: tuple[str, ...] = ("full", "adapter", "merged")


class ExportError(UserError):
    """A run, checkpoint or output that cannot be exported (exit 2); the message names the file."""


@dataclass(frozen=True)
class Exported:
    """One exported policy: where it is and what it holds."""

    policy: str
    path: Path
    kind: str
    """``full``, ``adapter`` (LoRA, peft format) or ``merged`` (LoRA merged into full weights)."""
    step: int
    dtype: str


# ----------------------------------------------------------------------------- checkpoints
def check_checkpoint(ck: str | os.PathLike[str]) -> dict[str, Any]:
    """The trainer state of checkpoint ``ck`` after checking it can be exported: present, of this
    code's format, every manifest file there with its recorded size. :class:`ExportError` names the
    first file at fault."""
    ck = Path(ck)
    state_file = ck / TRAINER_STATE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"checkpoint {ck} is incomplete: {state_file} is missing (it is written last, so the "
                          "checkpoint was never finished or was damaged since); pick another with --step") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{state_file} is damaged ({type(exc).__name__}: {exc}); pick another checkpoint "
                          "with --step") from None
    if not isinstance(state, dict) or "next_step" not in state or not isinstance(state.get("manifest"), dict):
        raise ExportError(f"{state_file} is damaged (no next_step or manifest); pick another checkpoint with --step")
    if state.get("format") != FORMAT_VERSION:
        raise ExportError(f"{state_file} was written in checkpoint format {state.get('format')!r}; mutualrl "
                          f"{__version__} reads format {FORMAT_VERSION}: export it with the mutualrl version that "
                          "wrote the run")
    for rel, size in sorted(state["manifest"].items()):
        f = ck / rel
        try:
            got = f.stat().st_size
        except OSError:
            raise ExportError(f"{f} is missing (the checkpoint's manifest lists it): the checkpoint is damaged; "
                              "pick another with --step") from None
        if got != size:
            raise ExportError(f"{f} has {got} bytes, the checkpoint's manifest says {size}: the file is damaged; "
                              "pick another checkpoint with --step")
    return state


def select_checkpoint(run_dir: str | os.PathLike[str], step: int | None = None) -> tuple[Path, dict[str, Any]]:
    """(checkpoint directory, trainer state) of the checkpoint after ``step`` steps, default the
    newest, checked by :func:`check_checkpoint` (a damaged newest one is refused, not skipped)."""
    root = Path(run_dir) / CHECKPOINTS
    found = {step_of(d): d for d in (root.iterdir() if root.is_dir() else []) if d.is_dir() and step_of(d) is not None}
    if not found:
        raise ExportError(f"run {str(run_dir)!r} has no checkpoint yet ({root} holds none): train it first")
    have = ", ".join(str(s) for s in sorted(found))
    if step is None:
        step = max(found)  # type: ignore[type-var]
    elif step not in found:
        raise ExportError(f"run {str(run_dir)!r} has no checkpoint of step {step}; it has steps {have} "
                          "(a run keeps its newest checkpoints only)")
    ck = found[step]
    return ck, check_checkpoint(ck)


# ----------------------------------------------------------------------------- the trained model
def lora_config(peft: Any) -> Any:
    """The ``peft.LoraConfig`` a policy with these ``peft`` settings trains with (as :class:`~mutualrl.rollout.policy.Policy`)."""
    from peft import LoraConfig

    return LoraConfig(r=peft.r, lora_alpha=peft.lora_alpha, lora_dropout=peft.lora_dropout,
                      target_modules=peft.target_modules, task_type="CAUSAL_LM")


def load_trained(pcfg: Any, policy_dir: str | os.PathLike[str]) -> tuple[Any, Any, str]:
    """(model, tokenizer, base model path) of policy ``pcfg`` (a ``policies[i]`` entry) with the
    weights of a checkpoint's ``policy_dir``: its base model, wrapped in its LoRA adapter when it has
    one, then the checkpoint's weights loaded strictly (every key it holds, nothing else), in float32."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = resolve_model_path(pcfg.model)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    keys = None
    if pcfg.peft is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(pcfg.peft))
        keys = [k for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad]
    weights = Path(policy_dir) / MODEL_FILE
    try:
        load_module(model, weights, keys)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ExportError(f"{weights} cannot be read ({type(exc).__name__}: {exc}): the file is damaged") from None
    model.eval()
    return model, tokenizer, base


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    from mutualrl.rollout.modeling import generation_stop_ids

    return sorted(stop_ids_of(tokenizer, generation_stop_ids(getattr(model, "generation_config", None))))


def _generation_config(model: Any, tokenizer: Any) -> Any:
    """The base's generation config, stopping on every id the policy stopped on in training."""
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    gen = copy.deepcopy(base) if base is not None else GenerationConfig()
    eos = _stop_ids(model, tokenizer)
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is not None:
        gen.pad_token_id = int(pad)
    return gen


def _check_mergeable(model: Any) -> None:
    """Refuse to merge an adapter on an output layer tied to the input embeddings: the merge adds it
    into the one shared weight, changing the embeddings too (the merged model is not the trained one)."""
    from mutualrl.rollout.modeling import lora_tied_head, tied_head_message

    base = model.get_base_model()
    for cfg in model.peft_config.values():
        name = lora_tied_head(base, cfg.target_modules)
        if name is not None:
            why = ("merging the adapter into the shared weight would change the input embeddings too, so "
                   "the merged model would not be the trained one")
            raise ExportError(tied_head_message(name, cfg.target_modules, "", why)
                              + ". Export the adapter instead (without --merge-lora)")


def write_model(model: Any, tokenizer: Any, directory: Path, *, kind: str, dtype: str) -> None:
    """Write ``model`` (a trained policy's, from :func:`load_trained`) into ``directory`` as ``kind``."""
    import torch

    if kind == "merged":
        _check_mergeable(model)
        model = model.merge_and_unload()
    model = model.to(getattr(torch, dtype))
    gen = _generation_config(model.get_base_model() if kind == "adapter" else model, tokenizer)
    if kind == "adapter":
        for cfg in model.peft_config.values():
            cfg.inference_mode = True
        model.save_pretrained(str(directory))
        gen.save_pretrained(str(directory))
    else:
        model.generation_config = gen
        model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


# ----------------------------------------------------------------------------- writing safely
@contextmanager
def staged_directory(final: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling of ``final`` to write into, renamed to ``final`` when the block ends
    without an error (an existing ``final`` is replaced only with ``overwrite``); removed otherwise."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists() and not overwrite:
            raise ExportError(f"{final} already exists; remove it or export with --force")
        publish_dir(tmp, final)
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- exporting
def _kind(pcfg: Any, merge_lora: bool) -> str:
    if pcfg.peft is None:
        return "full"
    return "merged" if merge_lora else "adapter"


def export_run(run_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str] | None = None, *,
               policies: Sequence[str] | None = None, step: int | None = None, merge_lora: bool = False,
               dtype: str = "float32", overwrite: bool = False) -> list[Exported]:
    """Export policies of the run in ``run_dir`` (all, or the named ``policies``) at the checkpoint
    after ``step`` steps (default: the newest) into ``output_dir/<policy>`` (default
    ``run_dir/export``); see the module docstring. Returns what was written, in config order."""
    from mutualrl.config.resolve import run_config

    run_dir = Path(run_dir)
    if not (run_dir / RUN_CONFIG).is_file():
        raise ExportError(f"{str(run_dir)!r} is not a mutualrl run directory (no {RUN_CONFIG})")
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        cfg = run_config(run_dir)
    except UserError as exc:  # e.g. a field this code does not know: written by another mutualrl version
        raise ExportError(f"{run_dir / RUN_CONFIG}: {exc}") from None
    names = [p.name for p in cfg.policies]
    wanted = list(dict.fromkeys(policies)) if policies else names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise ExportError(f"the run has no policy {unknown[0]!r}; its policies: {', '.join(names)}")
    out = Path(output_dir) if output_dir is not None else run_dir / EXPORT_DIR
    for n in wanted:
        if (out / n).exists() and not overwrite:
            raise ExportError(f"{out / n} already exists; remove it or export with --force")
    ck, state = select_checkpoint(run_dir, step)
    missing = [n for n in wanted if n not in state.get("policies", [])]
    if missing:
        raise ExportError(f"{ck / TRAINER_STATE} holds no policy {missing[0]!r} (it holds "
                          f"{', '.join(state.get('policies', []))})")
    steps_done = int(state["next_step"])
    done = []
    for pcfg in (p for p in cfg.policies if p.name in wanted):
        kind = _kind(pcfg, merge_lora)
        with quiet_transformers():
            model, tokenizer, _base = load_trained(pcfg, ck / pcfg.name)
            with staged_directory(out / pcfg.name, overwrite=overwrite) as tmp:
                write_model(model, tokenizer, tmp, kind=kind, dtype=dtype)
                facts = card_facts(run_dir, cfg, pcfg.name, step=steps_done, kind=kind, dtype=dtype)
                (tmp / "README.md").write_text(render_card(facts), encoding="utf-8")
                info = {"format": EXPORT_FORMAT, "mutualrl_version": __version__, "policy": pcfg.name,
                        "model": pcfg.model, "kind": kind, "dtype": dtype, "step": steps_done,
                        "run_dir": str(run_dir.resolve()), "checkpoint": ck.name,
                        "prompt_template": pcfg.prompt_template, "system_prompt": pcfg.system_prompt}
                (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        done.append(Exported(pcfg.name, out / pcfg.name, kind, steps_done, dtype))
        del model
    return done


def read_export_info(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What :func:`export_run` recorded in ``directory`` (:data:`EXPORT_INFO`), or None."""
    try:
        info = json.loads((Path(directory) / EXPORT_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


# ----------------------------------------------------------------------------- the command
def register(sub: argparse._SubParsersAction) -> None:
    """The ``export`` subcommand."""
    p = sub.add_parser(
        "export", help="write trained policies of a run as Hugging Face model directories (with a model card)",
        description="Export policies of a run from one of its checkpoints (default: the newest) as directories "
        "that transformers' AutoModelForCausalLM/AutoTokenizer.from_pretrained and vLLM load as they are: "
        "config, safetensors weights, tokenizer with its chat template, generation config, and a model card "
        "(README.md) with the task, strategy, peers and held-out accuracy. A LoRA policy is written as a peft "
        "adapter directory, or merged into full weights with --merge-lora. A damaged checkpoint, or one of "
        "another checkpoint format, is refused (exit 2) naming the file.")
    p.add_argument("run_dir", help="the run directory (as written by mutualrl train)")
    p.add_argument("--policy", action="append", metavar="NAME",
                   help="export only this policy (repeatable; default: every policy)")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint after N steps (default: the newest)")
    p.add_argument("-o", "--output", metavar="DIR", help="write DIR/<policy> (default: RUN_DIR/export)")
    p.add_argument("--merge-lora", action="store_true", help="LoRA policies: merge the adapter into full weights "
                   "instead of writing a peft adapter directory")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the written weights (default float32, the training's master weights)")
    p.add_argument("--force", action="store_true", help="replace existing export directories")
    p.add_argument("--push-to-hub", metavar="REPO",
                   help="then upload each directory to the Hugging Face Hub repository REPO (needs the network and "
                   "a token; with several policies REPO must contain {policy}, e.g. me/run-{policy})")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``mutualrl export``: 0 when written (and pushed), 2 for bad input, 1 when the upload failed."""
    run_dir = Path(args.run_dir)
    repos: dict[str, str] = {}
    if args.push_to_hub:  # a bad repository id fails here, before anything is written
        from mutualrl.config.resolve import run_config

        if not (run_dir / RUN_CONFIG).is_file():
            raise ExportError(f"{str(run_dir)!r} is not a mutualrl run directory (no {RUN_CONFIG})")
        names = args.policy or [p.name for p in run_config(run_dir).policies]
        repos = check_repo_ids(args.push_to_hub, names)
    done = export_run(run_dir, args.output, policies=args.policy, step=args.step, merge_lora=args.merge_lora,
                      dtype=args.dtype, overwrite=args.force)
    for e in done:
        print(f"{e.policy}: {e.path} ({e.kind}, step {e.step}, {e.dtype})")
    for e in done:
        if e.policy not in repos:
            continue
        try:
            url = push_to_hub(e.path, repos[e.policy], private=args.private)
        except HubPushError as exc:
            print(f"mutualrl: error: {exc}", file=sys.stderr)
            return 1
        print(f"{e.policy}: pushed to {url}")
    return 0
