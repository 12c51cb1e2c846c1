"""Run configuration: plain dataclasses, loaded from YAML and validated field by field.

Every validation failure raises :class:`~mutualrl.errors.ConfigError` naming the dotted field
path and what would be valid. Option names follow TRL's ``GRPOConfig`` where one exists
(``num_generations``, ``beta``, ``epsilon``, ``epsilon_high``, ``loss_type``, ``scale_rewards``,
``max_completion_length``, ``temperature``, ``num_iterations``, ``learning_rate``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mutualrl.errors import ConfigError

LossType = Literal["grpo", "token_mean", "dr_grpo"]
ScaleRewards = Literal["group", "batch", "none"]


@dataclass
class GRPOOptions:
    """GRPO options of one policy (run-level defaults, overridable per policy)."""

    num_generations: int = 8
    """Completions sampled per prompt (the GRPO group size G); at least 2."""
    learning_rate: float = 1e-4
    beta: float = 0.0
    """Weight of the k3 KL penalty to a frozen reference copy (0 = no reference model)."""
    epsilon: float = 0.2
    """Lower clip range of the PPO-style ratio: ratio >= 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clip range (ratio <= 1 + epsilon_high); defaults to ``epsilon``."""
    loss_type: LossType = "dr_grpo"
    """Aggregation: ``grpo`` (mean per sequence, then over sequences), ``token_mean`` (all tokens),
    ``dr_grpo`` (sum over tokens / (sequences x max_completion_length))."""
    scale_rewards: ScaleRewards = "group"
    """Advantage scale: the group's std, the batch's std, or none (Dr. GRPO)."""
    num_iterations: int = 1
    """Optimizer steps per batch (old log-probs reused when > 1)."""
    max_completion_length: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: ``bfloat16`` uses autocast for generation and the update, master weights and
    optimizer state stay float32."""


@dataclass
class DatasetConfig:
    """One task source: a reasoning-gym dataset (``name``) or a user file (``path``)."""

    name: str | None = None
    """reasoning-gym dataset name, e.g. ``basic_arithmetic`` (see ``mutualrl tasks list``)."""
    path: str | None = None
    """A ``.jsonl`` or ``.parquet`` file with question/answer columns (instead of ``name``)."""
    alias: str | None = None
    """Short name used in problem ids and per-type metrics (defaults to the dataset/file name)."""
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)
    """Options of the reasoning-gym dataset's config dataclass."""
    question_field: str = "question"
    answer_field: str = "answer"
    test_fraction: float = 0.2


@dataclass
class TaskConfig:
    datasets: list[DatasetConfig] = field(default_factory=list)
    test_size: int = 1000
    train_size: int = 20000
    seed: int = 0
    answer_extraction: str = "first_line"
    """``first_line``, ``last_number``, ``boxed``, ``raw`` or ``regex:<pattern>``."""
    reward_functions: list[str] = field(default_factory=list)
    """Extra TRL-style reward functions by import path ``package.module:function``."""
    reward_timeout_s: float = 10.0
    preset: str | None = None
    """``zoo`` = the embedded default task (addition + subtraction); replaces ``datasets``."""


@dataclass
class PolicyConfig:
    name: str = ""
    model: str = ""
    """``zoo:<name>``, ``real:<name>``, a local directory or a hub id (hub ids need network)."""
    prompt_template: str = "{question} Answer: "
    """A format string with ``{question}``, or ``chat`` to use the tokenizer's chat template."""
    system_prompt: str | None = None
    grpo: dict[str, Any] = field(default_factory=dict)
    """Per-policy overrides of the run-level ``grpo`` options."""


@dataclass
class SharingConfig:
    strategy: str = "independent"
    """``independent``, ``prp``, ``xgrpo``, ``sgt`` or a ``+`` combination (``xgrpo+sgt``)."""
    sgt_lambda: float = 0.1
    sgt_max_per_step: int = 16
    """Cap on rescue examples per learner per step."""
    prp_ratio_clip: float = 1.0
    """Truncation c of PRP's chunk importance ratios: weight = min(ratio, c)."""
    prp_max_peer_per_prompt: int = 4
    prp_peer_weight: float = 0.5
    """Scale of peer samples' loss relative to own samples."""
    max_staleness: int = 0
    """Peer rows older than this many versions are ignored (0 = this step's rows only)."""


@dataclass
class RunConfig:
    policies: list[PolicyConfig] = field(default_factory=list)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GRPOOptions = field(default_factory=GRPOOptions)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    steps: int = 200
    prompts_per_step: int = 16
    eval_every: int = 25
    eval_size: int = 400
    eval_batch_size: int = 256
    checkpoint_every: int = 50
    seed: int = 0
    exchange: str = "sqlite"
    """``sqlite`` (a file in the run directory), ``memory://``, ``sqlite:///path`` or ``ray://name``."""
    scheduler: Literal["sequential", "local", "ray"] = "sequential"
    threads: int | None = None
    """torch threads per worker (default: the allocation decides)."""
    step_timeout_s: float = 600.0
    sync: Literal["sync", "async"] = "sync"
    """``sync``: a barrier per step phase. ``async``: a faster policy may run up to
    ``sharing.max_staleness`` steps ahead of the slowest (evaluations and checkpoints still
    wait for everyone)."""
    tensorboard: bool = False
    output_dir: str | None = None

    def policy_grpo(self, index: int) -> GRPOOptions:
        """The effective GRPO options of policy ``index`` (run defaults + its overrides)."""
        pol = self.policies[index]
        merged = dataclasses.asdict(self.grpo) | dict(pol.grpo)
        return _build(GRPOOptions, merged, f"policies[{index}].grpo")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


# ----------------------------------------------------------------------------- generic builder
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, path)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, f"expected one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        (inner,) = typing.get_args(tp)
        return [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: Any, path: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(path or "<root>", f"expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(names)}"
            raise ConfigError(sub, f"unknown field{hint}")
        kwargs[key] = _coerce(hints[key], value, sub)
    return cls(**kwargs)


# ----------------------------------------------------------------------------- semantic checks
def _check_grpo(g: GRPOOptions, path: str) -> None:
    if g.num_generations < 2:
        raise ConfigError(f"{path}.num_generations", f"must be >= 2 for a group baseline, got {g.num_generations}")
    if not g.learning_rate > 0:
        raise ConfigError(f"{path}.learning_rate", f"must be > 0, got {g.learning_rate}")
    if g.beta < 0:
        raise ConfigError(f"{path}.beta", f"must be >= 0, got {g.beta}")
    if not 0 < g.epsilon < 1:
        raise ConfigError(f"{path}.epsilon", f"must be in (0, 1), got {g.epsilon}")
    if g.epsilon_high is not None and g.epsilon_high <= 0:
        raise ConfigError(f"{path}.epsilon_high", f"must be > 0, got {g.epsilon_high}")
    if g.num_iterations < 1:
        raise ConfigError(f"{path}.num_iterations", f"must be >= 1, got {g.num_iterations}")
    if g.max_completion_length < 1:
        raise ConfigError(f"{path}.max_completion_length", f"must be >= 1, got {g.max_completion_length}")
    if not g.temperature > 0:
        raise ConfigError(f"{path}.temperature", f"must be > 0, got {g.temperature}")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"{path}.top_p", f"must be in (0, 1], got {g.top_p}")


def validate(cfg: RunConfig, *, check_paths: bool = True) -> RunConfig:
    """Semantic validation (types were checked while building). Raises ConfigError."""
    from mutualrl.algorithms.sharing import check_strategy_name
    from mutualrl.tasks.base import validate_extraction_mode

    for name in ("steps", "prompts_per_step", "eval_every", "eval_size", "eval_batch_size", "checkpoint_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(name, f"must be a positive integer, got {getattr(cfg, name)}")
    if cfg.step_timeout_s <= 0:
        raise ConfigError("step_timeout_s", "must be > 0")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError("threads", f"must be >= 1, got {cfg.threads}")
    if not cfg.policies:
        raise ConfigError("policies", "at least one policy is required (name + model)")
    _check_grpo(cfg.grpo, "grpo")  # first, so a bad run-level value is named as such, not per policy
    seen = set()
    for i, pol in enumerate(cfg.policies):
        p = f"policies[{i}]"
        if not pol.name or not pol.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{p}.name", f"must be a non-empty name of letters, digits, '-' or '_', got {pol.name!r}")
        if pol.name in seen:
            raise ConfigError(f"{p}.name", f"duplicate policy name {pol.name!r}")
        seen.add(pol.name)
        if not pol.model:
            raise ConfigError(f"{p}.model", "required: zoo:<name>, real:<name>, a local model directory or a hub id")
        if check_paths:
            _check_model_ref(pol.model, f"{p}.model")
        if pol.prompt_template != "chat" and "{question}" not in pol.prompt_template:
            raise ConfigError(f"{p}.prompt_template", "must contain '{question}' or be 'chat'")
        _check_grpo(cfg.policy_grpo(i), f"{p}.grpo")
    t = cfg.task
    if t.preset not in (None, "zoo"):
        raise ConfigError("task.preset", f"expected 'zoo' or nothing, got {t.preset!r}")
    if t.preset is None and not t.datasets:
        raise ConfigError("task.datasets", "give at least one dataset (name: <reasoning-gym dataset> or path: FILE), "
                          "or set task.preset: zoo")
    for i, d in enumerate(t.datasets):
        p = f"task.datasets[{i}]"
        if (d.name is None) == (d.path is None):
            raise ConfigError(p, "give exactly one of 'name' (reasoning-gym dataset) or 'path' (JSONL/Parquet file)")
        if d.weight <= 0:
            raise ConfigError(f"{p}.weight", f"must be > 0, got {d.weight}")
        if d.name is not None:
            from mutualrl.tasks.gym import check_dataset

            err = check_dataset(d.name, {k: tuple(v) if isinstance(v, list) else v for k, v in d.config.items()})
            if err:
                raise ConfigError(f"{p}.name" if "unknown reasoning-gym" in err else f"{p}.config", err)
        elif check_paths and not Path(d.path).is_file():
            raise ConfigError(f"{p}.path", f"file {d.path!r} does not exist")
    if t.test_size < 1 or t.train_size < 1:
        raise ConfigError("task.test_size", "test_size and train_size must be positive")
    err = validate_extraction_mode(t.answer_extraction)
    if err:
        raise ConfigError("task.answer_extraction", err)
    for i, rf in enumerate(t.reward_functions):
        from mutualrl.tasks.rewards import load_reward_function

        try:
            load_reward_function(rf)
        except ValueError as exc:
            raise ConfigError(f"task.reward_functions[{i}]", str(exc)) from None
    err = check_strategy_name(cfg.sharing.strategy)
    if err:
        raise ConfigError("sharing.strategy", err)
    s = cfg.sharing
    if s.sgt_lambda < 0 or s.sgt_max_per_step < 0 or s.prp_ratio_clip <= 0 or s.prp_peer_weight < 0:
        raise ConfigError("sharing", "sgt_lambda, sgt_max_per_step, prp_peer_weight must be >= 0 and prp_ratio_clip > 0")
    if s.max_staleness < 0:
        raise ConfigError("sharing.max_staleness", "must be >= 0")
    if len(cfg.policies) < 2 and s.strategy != "independent":
        raise ConfigError("sharing.strategy", f"{s.strategy!r} shares between policies: give at least 2 policies "
                          "or use 'independent'")
    ex = cfg.exchange
    if not (ex == "sqlite" or ex.startswith(("sqlite:///", "memory://", "ray://"))):
        raise ConfigError("exchange", f"expected 'sqlite', 'sqlite:///PATH', 'memory://' or 'ray://NAME', got {ex!r}")
    return cfg


def _check_model_ref(ref: str, path: str) -> None:
    if ref.startswith("zoo:"):
        from mutualrl import zoo

        name, _, zseed = ref[4:].partition("@")
        if zseed and not zseed.isdigit():
            raise ConfigError(path, f"zoo seed in {ref!r} must be an integer (zoo:NAME@SEED)")
        if name not in zoo.ZOO:
            close = difflib.get_close_matches(name, list(zoo.ZOO), n=1)
            hint = f" (did you mean 'zoo:{close[0]}'?)" if close else ""
            raise ConfigError(path, f"unknown zoo policy {name!r}{hint}; available: {', '.join(sorted(zoo.ZOO))}")
        return
    if ref.startswith("real:"):
        from mutualrl import realmodels

        names = list(getattr(realmodels, "MODELS", {}) or ["smollm2", "gemma3"])
        if ref[5:] not in names:
            raise ConfigError(path, f"unknown real model {ref[5:]!r}; available: {', '.join(names)}")
        return
    p = Path(ref)
    if ref.startswith((".", "/", "~")) or p.exists():
        p = p.expanduser()
        if not p.is_dir():
            raise ConfigError(path, f"model directory {ref!r} does not exist")
        if not (p / "config.json").is_file():
            raise ConfigError(path, f"{ref!r} is not a Hugging Face model directory (no config.json)")


def _one_line_yaml_error(exc: Exception) -> str:
    """A YAML (or decoding) error as one line: what is wrong and where."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def load_config(source: str | Path | dict[str, Any], *, check_paths: bool = True,
                overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load, build and validate a run config from a YAML file path or a dict."""
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError("<file>", f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError("<file>", f"{path} is not valid YAML: {_one_line_yaml_error(exc)}") from None
        if data is None:
            data = {}
    if overrides:
        data = {**data, **overrides}
    cfg = _build(RunConfig, data, "")
    return validate(cfg, check_paths=check_paths)
