"""Any model on a run's task: held-out accuracy with the run's prompts, template, extraction and verifier.

``mutualrl eval --model DIR_OR_HUB_ID --config CFG.yaml [--policy NAME]`` (or, in Python,
:func:`evaluate_model`) puts a base model, an exported policy (a full directory or a LoRA adapter
directory from ``mutualrl export``), another team's model or a hub id on exactly the problems a run
evaluates its policies on: the config's task (its held-out test problems, ``eval_size`` of them),
the named policy's ``prompt_template``/``system_prompt`` (or ``prompt_template``/``system_prompt``
given here), its GRPO options (``max_completion_length``), the task's answer extraction and each
source's verifier. It runs the worker's own evaluation (:meth:`~mutualrl.run.worker.PolicyWorker.evaluate`)
on a one-policy copy of the config whose model is the one given, so a figure here and a run's
``test_acc`` are the same measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mutualrl.config import parse_config
from mutualrl.config.modelref import ModelRef, ModelRefError
from mutualrl.errors import UserError
from mutualrl.export.model import read_export_info
from mutualrl.paths import RUN_CONFIG
from mutualrl.tasks.build import eval_problems

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _config_source(config: Any) -> Any:
    """A config given as a run directory means its saved ``config.yaml``."""
    if isinstance(config, (str, Path)) and Path(config).is_dir():
        if not (Path(config) / RUN_CONFIG).is_file():
            raise UserError(f"--config {str(config)!r} is a directory but not a run directory (no {RUN_CONFIG})")
        return Path(config) / RUN_CONFIG
    return config


def _pick_policy(names: list[str], policy: str | None, info: dict[str, Any] | None) -> int:
    if policy is not None:
        if policy not in names:
            raise UserError(f"--policy {policy!r} is not a policy of the config; its policies: {', '.join(names)}")
        return names.index(policy)
    if info and info.get("policy") in names:  # an export knows which policy it was
        return names.index(info["policy"])
    if len(names) == 1:
        return 0
    raise UserError(f"the config has policies {', '.join(names)}: name the one whose prompt template and options "
                    "the model is evaluated with (--policy NAME)")


def _model_entry(model: str, info: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None, Path | None]:
    """(model reference for the policy, its LoRA settings or None, the adapter directory or None) of
    ``model``; :class:`UserError` when it is no model this can load."""
    try:
        ref = ModelRef.parse(model)
    except ModelRefError as exc:
        raise UserError(f"--model: {exc}") from None
    if ref.kind != "dir":
        return model, None, None
    d = Path(ref.name)
    if not d.is_dir():
        raise UserError(f"--model {model!r}: no such directory")
    if (d / "config.json").is_file():
        return str(d), None, None
    if not (d / ADAPTER_CONFIG).is_file():
        raise UserError(f"--model {model!r} is not a Hugging Face model directory (no config.json) nor a peft adapter "
                        f"directory (no {ADAPTER_CONFIG})")
    adapter = json.loads((d / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    if adapter.get("peft_type", "LORA") != "LORA":
        raise UserError(f"--model {model!r}: only LoRA adapters are evaluated, this one is {adapter.get('peft_type')}")
    base = (info or {}).get("model") or adapter.get("base_model_name_or_path")
    if not base:
        raise UserError(f"--model {model!r}: {ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    targets = adapter.get("target_modules")
    peft = {"r": adapter.get("r", 8), "lora_alpha": adapter.get("lora_alpha", 8),
            "lora_dropout": adapter.get("lora_dropout", 0.0),
            "target_modules": sorted(targets) if isinstance(targets, (list, set)) else targets}
    return base, peft, d


def _load_adapter(policy: Any, directory: Path) -> None:
    """Load a peft adapter directory's weights into ``policy``'s LoRA-wrapped model (strictly)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise UserError(f"--model {str(directory)!r}: {ADAPTER_WEIGHTS} is missing")
    result = set_peft_model_state_dict(policy.model, load_file(str(weights)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise UserError(f"--model {str(directory)!r}: the adapter does not fit its base model (unexpected "
                        f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]})")
    policy.sync_engine()


def evaluate_model(model: str, config: Any, *, policy: str | None = None, prompt_template: str | None = None,
                   system_prompt: str | None = None, size: int | None = None,
                   device: str | None = None) -> dict[str, Any]:
    """Greedy held-out accuracy of ``model`` on ``config``'s task, measured as the run measures its policies.

    Args:
        model: a model directory (``mutualrl export`` output, full or LoRA adapter), a hub id, or a
            ``zoo:``/``real:`` reference.
        config: the run config (a YAML path, a run directory, a mapping or a ``RunConfig``).
        policy: the config's policy whose prompt template, system prompt and GRPO options apply
            (default: the exported policy's name, or the only policy).
        prompt_template, system_prompt: replace the policy's.
        size: number of held-out problems (default: the config's ``eval_size``).
        device: ``cpu`` (default, as ``mutualrl eval``), ``cuda``, ``cuda:N``.

    Returns:
        ``{"model", "policy", "prompt_template", "system_prompt", "problems", "test_acc",
        "test_acc/<type>"...}``. Bad input raises :class:`~mutualrl.errors.UserError`.
    """
    from mutualrl.config.resolve import plan_of, resolve
    from mutualrl.run.worker import PolicyWorker

    cfg = resolve(_config_source(config)).config
    names = [p.name for p in cfg.policies]
    info = read_export_info(model) if Path(model).expanduser().is_dir() else None
    index = _pick_policy(names, policy, info)
    if prompt_template is not None and prompt_template != "chat" and "{question}" not in prompt_template:
        raise UserError(f"--prompt-template must contain '{{question}}' or be 'chat', got {prompt_template!r}")
    ref, peft, adapter_dir = _model_entry(model, info)
    data = cfg.to_dict()
    entry = data["policies"][index]
    entry.update(model=ref, peft=peft)
    if adapter_dir is not None:
        entry["generation"]["engine"] = "hf"  # the adapter is loaded into the policy's own module
    if prompt_template is not None:
        entry["prompt_template"] = prompt_template
    if system_prompt is not None:
        entry["system_prompt"] = system_prompt
    data.update(policies=[entry], sharing={"strategy": "independent"}, exchange="sqlite", scheduler="sequential",
                report_to=[])
    if device is not None:
        data["device"] = device
    worker = None
    try:
        worker = PolicyWorker(plan_of(parse_config(data)), 0, None)
        if adapter_dir is not None:
            _load_adapter(worker.policy, adapter_dir)
        n = size or cfg.eval_size
        result = worker.evaluate(n)
        problems = len(eval_problems(worker.task, n))
    except OSError as exc:  # a hub id that cannot be loaded here, a directory missing its files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--model {model!r} cannot be loaded ({first})") from None
    finally:
        if worker is not None:
            worker.close()
    return {"model": model, "policy": entry["name"], "prompt_template": entry["prompt_template"],
            "system_prompt": entry["system_prompt"], "problems": problems, **result}


def cmd_eval_model(args: argparse.Namespace) -> int:
    """``mutualrl eval --model M --config CFG`` (or ``mutualrl eval RUN_DIR --model M``)."""
    config = args.config or args.run_dir
    if config is None:
        raise UserError("--model needs the task to evaluate on: --config CFG.yaml (or a run directory)")
    if args.config and args.run_dir:
        raise UserError("give either RUN_DIR or --config, not both")
    res = evaluate_model(args.model, config, policy=args.policy, prompt_template=args.prompt_template,
                         system_prompt=args.system_prompt, size=args.size, device=args.device)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    out = sys.stdout
    out.write(f"model {res['model']} on {res['problems']} held-out problems, prompted as policy {res['policy']!r} "
              f"({res['prompt_template']!r})\n")
    for key, value in res.items():
        if key == "test_acc" or key.startswith("test_acc/"):
            label = "all" if key == "test_acc" else key.split("/", 1)[1]
            out.write(f"  {label:<12} {100 * value:6.1f} %\n")
    return 0
