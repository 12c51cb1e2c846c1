"""One way in: a YAML file (or dict), overrides and the machine become one frozen, validated plan.

:func:`resolve` is the only place where settings are read and checked: ``mutualrl train``,
``--resume``, ``eval``, ``plan``, the Python API, the trainer and every scheduler consume the
:class:`RunPlan` it returns unchanged; worker processes receive it as JSON
(:meth:`RunPlan.to_dict`) and rebuild it without re-reading anything. Overrides are dotted paths
into the config (``policies.0.grpo.learning_rate=3e-5``, :func:`parse_overrides`); on a resumed
run an override is applied only where it cannot change what was already computed (:data:`~mutualrl.config.RESUMABLE`)
and refused otherwise, naming the field (:func:`resolve_run`).

The checks here are those that look outside the config: strategy names (the registry), datasets
and data files, reward functions, model references and directories, devices, LoRA and vLLM
availability, the exchange URL; :func:`mutualrl.config.check_config` did the config's own.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from mutualrl.algorithms.registry import (
    available_strategies,
    check_strategy_name,
    parse_strategy,
    strategy_step,
)
from mutualrl.config import (  # noqa: F401  (RESUMABLE: re-exported, its documented home here)
    RESUMABLE,
    GRPOOptions,
    RunConfig,
    TaskConfig,
    check_config,
    check_task,
    parse_config,
    read_config_data,
)
from mutualrl.config.modelref import ModelRef, ModelRefError
from mutualrl.config.overrides import apply_overrides, parse_overrides  # noqa: F401  (re-exported)
from mutualrl.config.schema import build, freeze
from mutualrl.errors import ConfigError, UserError
from mutualrl.exchange.url import ExchangeURL
from mutualrl.paths import RUN_CONFIG
from mutualrl.rollout.engines.vllm import check_vllm
from mutualrl.run.devices import check_device, cuda_supports_bf16
from mutualrl.run.tracking import missing_package
from mutualrl.tasks.base import validate_extraction_mode
from mutualrl.tasks.build import build_source, build_task
from mutualrl.tasks.gold_check import check_gold_answers
from mutualrl.tasks.gym import check_dataset
from mutualrl.tasks.rewards import load_reward_function
from mutualrl.tasks.rows import SourceFieldError


@dataclass(frozen=True)
class WorkerSpec:
    """What one policy worker runs with: its policy, its effective GRPO options and, once the plan is
    placed (:mod:`mutualrl.allocation.placement`, the one placement step), where it runs: the device
    it computes on as it names it, the physical GPU its process is given, its share of that GPU, its
    torch threads and CPU priority, its Ray node and core share, and the exchange it opens."""

    index: int
    name: str
    options: GRPOOptions
    device: str | None = None
    visible_gpu: int | None = None
    """The physical GPU the worker's process sees as ``cuda:0`` (``CUDA_VISIBLE_DEVICES``; local scheduler)."""
    gpu_fraction: float | None = None
    """The share of its GPU's memory the worker may take (None: all of it)."""
    threads: int | None = None
    nice: int = 0
    node: str | None = None
    cpu_share: float | None = None
    exchange: str | None = None
    rank: int = 0
    """This worker's rank among its policy's ``workers`` (data-parallel ranks; 0 for a policy of one)."""
    world: int = 1
    """The policy's number of ranks."""
    rendezvous: str | None = None
    """Where the policy's ranks meet (``tcp://HOST:PORT/PREFIX``, the scheduler's store; ``world`` > 1)."""
    memory_bytes: int | None = None
    """The memory the plan gives the worker (:mod:`mutualrl.allocation.memory`)."""
    micro_batch_tokens: int | None = None
    """The update's micro-batch budget the plan resolved (``grpo.micro_batch_tokens: auto``, or the
    number asked for, checked to fit); None: the policy's own setting."""
    predicted_peak_bytes: int | None = None
    """The worker's predicted peak memory (logged beside the measured one)."""
    predicted_resident_bytes: int | None = None
    """The part of that peak the worker holds between phases (weights, gradients, optimizer state, the
    sampler's copy, the process): logged too, so that a process holding several policies is priced as
    their residents plus the largest transient (:mod:`mutualrl.study.run_price`)."""
    vllm_memory_fraction: float | None = None
    """A vLLM engine's share of its GPU (``gpu_memory_utilization``), derived by the plan."""
    sharing: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    """Every sharing step's settings for this policy, by step name: the step's own settings instances
    (its ``sharing.<step>`` block with the policy's ``policies[i].sharing`` overrides merged in),
    resolved once (:func:`step_settings`); the worker trains with them and the cost model prices them."""

    PLACEMENT: ClassVar[tuple[str, ...]] = ("device", "visible_gpu", "gpu_fraction", "threads", "nice", "node",
                                            "cpu_share", "exchange", "rendezvous", "memory_bytes",
                                            "micro_batch_tokens", "predicted_peak_bytes", "predicted_resident_bytes",
                                            "vllm_memory_fraction")

    @property
    def label(self) -> str:
        """The worker as errors and logs name it: the policy, and its rank when it has several."""
        return self.name if self.world == 1 else f"{self.name} rank {self.rank}"


@dataclass(frozen=True)
class RunPlan:
    """A run's resolved settings: the validated config (frozen, all the way down) and one
    :class:`WorkerSpec` per policy; ``placed`` once the placement step has filled them in."""

    config: RunConfig
    workers: tuple[WorkerSpec, ...]
    """Every worker, policy by policy and rank by rank within a policy."""
    data_read: bool = False
    """Whether the task's data and the models' hub ids were read while resolving (``read_data``)."""
    placed: bool = False

    def __post_init__(self) -> None:
        freeze(self.config)  # nothing may change a resolved config: a new one is resolved again

    def spec(self, index: int, rank: int = 0) -> WorkerSpec:
        """The worker of policy ``index`` at ``rank``."""
        for w in self.workers:
            if w.index == index and w.rank == rank:
                return w
        raise KeyError(f"no worker for policy {index} rank {rank}")

    def unplaced(self) -> RunPlan:
        """The same plan before any placement (one spec per rank the config fixes), to place again."""
        return self if not self.placed else dataclasses.replace(plan_of(self.config), data_read=self.data_read)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (for a worker process or actor): the config and the placements."""
        return {"config": self.config.to_dict(), "placed": self.placed,
                "placements": [{k: getattr(w, k) for k in ("index", "rank", "world", *WorkerSpec.PLACEMENT)}
                               for w in self.workers]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunPlan:
        """Inverse of :meth:`to_dict`: the plan a controller resolved (its checks are not run again)."""
        plan = plan_of(parse_config(copy.deepcopy(dict(d["config"]))))
        placements = d.get("placements", [])
        if not placements:
            return dataclasses.replace(plan, placed=bool(d.get("placed")))
        base = {w.index: w for w in plan.workers}  # the policy's options; ranks and places as written
        workers = tuple(dataclasses.replace(base[int(pl["index"])], rank=int(pl.get("rank", 0)),
                                            world=int(pl.get("world", 1)),
                                            **{k: pl[k] for k in WorkerSpec.PLACEMENT if k in pl})
                        for pl in placements)
        return dataclasses.replace(plan, workers=workers, placed=bool(d.get("placed")))


def step_settings(cfg: RunConfig, index: int) -> Mapping[str, Any]:
    """Policy ``index``'s sharing steps' settings, by step name, as the steps' own settings instances:
    each ``sharing.<step>`` block with the policy's ``policies[i].sharing`` overrides merged in (a
    run's own steps' modules, ``sharing.modules``, imported first)."""
    import_strategy_modules(cfg.sharing.modules)
    return MappingProxyType(parse_strategy(cfg.sharing.strategy).settings(cfg.policy_sharing(index)))


def plan_of(cfg: RunConfig) -> RunPlan:
    """The plan of an already checked config (not placed yet)."""
    ranks = [p.workers if isinstance(p.workers, int) else 1 for p in cfg.policies]  # auto: the placement decides
    settings = [step_settings(cfg, i) for i in range(len(cfg.policies))]
    return RunPlan(cfg, tuple(WorkerSpec(i, p.name, freeze(cfg.policy_grpo(i)), rank=r, world=ranks[i],
                                         sharing=settings[i])
                              for i, p in enumerate(cfg.policies) for r in range(ranks[i])))


# ----------------------------------------------------------------------------- resolving
def resolve(source: str | Path | Mapping[str, Any] | RunConfig | RunPlan, overrides: Mapping[str, Any] | None = None,
            *, check_paths: bool = True, read_data: bool = False) -> RunPlan:
    """Read ``source`` (a YAML path, a mapping, a :class:`RunConfig` or a plan), apply ``overrides``
    (dotted paths) and check everything; the frozen :class:`RunPlan`. Raises :class:`ConfigError`
    (a :class:`UserError`: exit code 2) naming the first bad field. ``check_paths=False`` skips
    what needs the files (model directories, data files), e.g. to plan for another machine;
    ``read_data`` also builds the task (reads every data file: seconds) and asks the hub for the
    config of each hub model, as a run does before it writes anything."""
    if isinstance(source, RunPlan):
        if overrides:
            return resolve(source.config, overrides, check_paths=check_paths, read_data=read_data)
        if read_data and not source.data_read:  # checked already: only the data is left to read
            _read_data(source.config)
            return dataclasses.replace(source, data_read=True)
        return source
    if isinstance(source, RunConfig):
        data: dict[str, Any] = source.to_dict()
    else:
        data = dict(read_config_data(source if not isinstance(source, Mapping) else dict(source)))
    if overrides:
        data = apply_overrides(data, overrides)
    cfg = parse_config(data)
    check_outside(cfg, check_paths=check_paths)
    if read_data:
        _read_data(cfg)
    return dataclasses.replace(plan_of(cfg), data_read=read_data)


def _read_data(cfg: RunConfig) -> None:
    """What only shows when it is read: the task's data (each source's columns, splits and gold
    answers, named by its field), hub model ids."""
    sources = []
    for i, d in enumerate(cfg.task.datasets if cfg.task.preset is None else []):
        try:
            sources.append(build_source(d))
        except SourceFieldError as exc:
            raise ConfigError(f"task.datasets[{i}].{exc.field}", str(exc)) from None
        except (ValueError, OSError, ImportError) as exc:
            raise ConfigError(f"task.datasets[{i}]", str(exc)) from None
        check_gold_answers(sources[-1], cfg.task, i)  # gold answers no completion could match
    try:
        build_task(cfg.task, sources or None)
    except (ValueError, OSError) as exc:
        raise UserError(f"task: {exc}") from None
    for i, pol in enumerate(cfg.policies):
        if ModelRef.parse(pol.model).kind != "hub":
            continue
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(pol.model)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"policies[{i}].model", f"{pol.model!r} is neither a local model directory nor a "
                              f"model id that can be loaded ({first})") from None


def resolve_run(run_dir: str | Path, overrides: Mapping[str, Any] | None = None) -> RunPlan:
    """The plan of an existing run directory (its saved ``config.yaml``) for ``--resume`` and
    ``eval``: overrides of :data:`~mutualrl.config.RESUMABLE` fields are applied, any other is refused naming it."""
    from mutualrl.run.resume import check_resumable

    d = Path(run_dir)
    if not (d / RUN_CONFIG).is_file():
        raise UserError(f"{str(d)!r} is not a mutualrl run directory (no {RUN_CONFIG})")
    plan = resolve(d / RUN_CONFIG, overrides)
    if overrides:
        check_resumable(run_config(d), plan.config, d)
    return plan


def run_config(run_dir: str | Path) -> RunConfig:
    """The config a run directory was trained with (as saved; its paths are not checked again)."""
    return parse_config(read_config_data(Path(run_dir) / RUN_CONFIG))


def load_config(source: str | Path | Mapping[str, Any] | RunConfig, *, check_paths: bool = True,
                overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The checked :class:`RunConfig` of ``source`` (:func:`resolve`'s config)."""
    return resolve(source, overrides, check_paths=check_paths).config


def resolve_task(data: Any, *, check_paths: bool = True) -> TaskConfig:
    """A checked ``task:`` section on its own (``mutualrl zoo build --task``)."""
    task = build(TaskConfig, data, "task")
    check_task(task)
    _check_task_outside(task, check_paths)
    return task


def check_outside(cfg: RunConfig, *, check_paths: bool = True) -> RunConfig:
    """The checks of a config against the world outside it (see the module docstring)."""
    check_config(cfg)
    err = check_device(cfg.device)
    if err:
        raise ConfigError("device", err)
    for i in range(len(cfg.policies)):
        _check_policy(cfg, i, check_paths)
    _check_task_outside(cfg.task, check_paths)
    for name in cfg.report_to:
        missing = missing_package(name)
        if missing:
            raise ConfigError("report_to", f"{name!r} needs the {missing} package: pip install {missing} (or "
                              "mutualrl[tracking])")
    check_sharing(cfg)
    if cfg.exchange != "sqlite":
        try:
            ExchangeURL.from_str(cfg.exchange)
        except UserError as exc:
            raise ConfigError("exchange", f"{exc} (or 'sqlite': a file in the run directory)") from None
    return cfg


def import_strategy_modules(modules: Sequence[str]) -> None:
    """Import the modules that register a run's own sharing steps (``sharing.modules``); a module
    that does not import is a ``ConfigError`` naming ``sharing.modules[i]``."""
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the config's problem
            raise ConfigError(f"sharing.modules[{i}]", f"cannot import {name!r}: {type(exc).__name__}: {exc}") from None


def check_sharing(cfg: RunConfig) -> None:
    """The ``sharing`` section against the strategy registry: the chain parses, every ``sharing.<step>``
    block belongs to a registered step and holds valid settings (bounds included), and a chain that
    reads peers' rows has peers."""
    sh = cfg.sharing
    import_strategy_modules(sh.modules)
    err = check_strategy_name(sh.strategy)
    if err:
        raise ConfigError("sharing.strategy", err)
    known = available_strategies()
    fields = [f.name for f in dataclasses.fields(sh) if f.name != "steps"]
    for name, block in sh.steps.items():
        step = strategy_step(name)
        if step is None:
            close = difflib.get_close_matches(name, known + fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"sharing.{name}", f"unknown field or sharing step{hint} (fields: {', '.join(fields)}; "
                              f"steps: {', '.join(known)})")
        if step.settings is None:
            raise ConfigError(f"sharing.{name}", f"step {name!r} has no settings; remove the block")
        step.settings_from(block)
    strategy = parse_strategy(sh.strategy)
    chain = {s.name for s in strategy.all_steps}
    for i, pol in enumerate(cfg.policies):
        for name, block in pol.sharing.items():
            step = strategy_step(name)
            if step is None or name not in chain or step.settings is None:
                raise ConfigError(f"policies[{i}].sharing.{name}", f"overrides a step the strategy {sh.strategy!r} "
                                  f"does not run with settings (steps with settings here: "
                                  f"{', '.join(sorted(s.name for s in strategy.all_steps if s.settings)) or 'none'})")
            if not isinstance(block, dict):
                raise ConfigError(f"policies[{i}].sharing.{name}", "a mapping of the step's fields to values")
            try:
                step.settings_from(cfg.policy_sharing(i).get(name))
            except ConfigError as exc:
                raise ConfigError(f"policies[{i}].{exc.field}", exc.reason) from None
    if len(cfg.policies) < 2 and strategy.reads:
        raise ConfigError("sharing.strategy", f"{sh.strategy!r} reads the peers' rows: give at least 2 policies, or "
                          "use 'independent' (or a step that needs no peer, such as 'self_imitate')")


def _check_task_outside(t: TaskConfig, check_paths: bool) -> None:
    for i, d in enumerate(t.datasets):
        p = f"task.datasets[{i}]"
        if d.name is not None:
            err = check_dataset(d.name, {k: tuple(v) if isinstance(v, list) else v for k, v in d.config.items()})
            if err:
                raise ConfigError(f"{p}.name" if "unknown reasoning-gym" in err else f"{p}.config", err)
            continue
        if d.path is not None and check_paths and not Path(d.path).is_file():
            raise ConfigError(f"{p}.path", f"file {d.path!r} does not exist")
        if d.dataset is not None:
            if importlib.util.find_spec("datasets") is None:
                raise ConfigError(f"{p}.dataset", "Hugging Face datasets need the datasets package: pip install "
                                  "datasets (or mutualrl[data])")
            local = d.dataset.startswith((".", "/", "~"))
            if check_paths and local and not Path(d.dataset).expanduser().is_dir():
                raise ConfigError(f"{p}.dataset", f"dataset directory {d.dataset!r} does not exist")
        if d.verifier == "math" and importlib.util.find_spec("math_verify") is None:
            raise ConfigError(f"{p}.verifier", "verifier: math needs math-verify: pip install math-verify "
                              "(or mutualrl[data])")
        err = validate_extraction_mode(d.answer_extractor)
        if err:
            raise ConfigError(f"{p}.answer_extractor", f"{err}, got {d.answer_extractor!r}")
    err = validate_extraction_mode(t.answer_extraction)
    if err:
        raise ConfigError("task.answer_extraction", f"{err}, got {t.answer_extraction!r}")
    for i, rf in enumerate(t.reward_functions):
        try:
            load_reward_function(rf)
        except ValueError as exc:
            raise ConfigError(f"task.reward_functions[{i}]", str(exc)) from None


def _check_policy(cfg: RunConfig, i: int, check_paths: bool) -> None:
    pol = cfg.policies[i]
    p = f"policies[{i}]"
    try:
        ref = ModelRef.parse(pol.model)
    except ModelRefError as exc:
        raise ConfigError(f"{p}.model", str(exc)) from None
    if check_paths and ref.kind == "dir":
        path = Path(ref.name)
        if not path.is_dir():
            raise ConfigError(f"{p}.model", f"model directory {pol.model!r} does not exist")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{p}.model", f"{pol.model!r} is not a Hugging Face model directory (no config.json)")
    err = check_device(pol.device)
    if err:
        raise ConfigError(f"{p}.device", err)
    dev = pol.device if pol.device != "auto" else cfg.device
    if cfg.policy_grpo(i).dtype == "bfloat16" and dev.startswith("cuda") and not cuda_supports_bf16(dev):
        raise ConfigError(f"{p}.grpo.dtype", f"bfloat16 is not supported by {dev}; use dtype: auto or float32")
    if pol.peft is not None and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{p}.peft", "LoRA needs the peft package: pip install peft (or mutualrl[peft])")
    if pol.generation.engine == "vllm":
        local = ref.local_dir()
        err = check_vllm(str(local) if local is not None and local.is_dir() else None)
        if err:
            raise ConfigError(f"{p}.generation.engine", err)
