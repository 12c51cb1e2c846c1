"""MWRA's memory price: the bytes a policy's worker holds at its peak, and the micro-batch that fits.

A policy's peak during an update is its *resident* bytes plus one micro-batch's activations:

* weights (fp32 master copy), gradients of the trainable weights, AdamW's two moments per
  optimizer phase (the policy's own and one per sharing phase that asks for its own step), the
  frozen reference copy (``beta > 0`` without LoRA), the sampler's extra copy (packed CPU linears,
  or FSDP's gathered one) and its KV cache for the rows it samples at once, the LM head's chunk of
  logits, and the process itself (Python, torch, the tokenizer);
* activations: bytes per forward token x the micro-batch's forward tokens
  (:mod:`mutualrl.algorithms.micro_batch`). A prior from the model's shape, replaced by a
  measurement when one exists (a worker's first update reports ``act_bytes_per_token``;
  ``mutualrl plan --calibrate`` measures it with a probe).

The memory a policy is given: on CPU the machine's RAM less headroom, split over the workers
whose updates can overlap (one pool under the sequential scheduler, whose policies update one
after another; every process its own part otherwise); on a GPU the card's memory share the plan
gives the worker. ``micro_batch_tokens: auto`` takes the largest budget whose peak fits it, in
steps of :data:`BUDGET_QUANTUM` tokens (so a budget, and with it the update's float rounding,
does not move with a few megabytes). A plan whose resident bytes alone do not fit, or whose fixed
budget does not, is refused before anything runs (:class:`MemoryPlanError`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FP32 = 4
CPU_HEADROOM = 0.85
"""Share of the machine's RAM the plan hands out on CPU (the rest: the OS, the exchange, the controller)."""
GPU_HEADROOM = 0.9
"""Share of a card's memory the plan hands out (CUDA contexts and the allocator's slack take the rest)."""
PROCESS_BYTES = 700 * 2**20
"""A worker process before any model: Python, torch, transformers, tokenizers (measured ~0.6-0.8 GiB)."""
BUDGET_QUANTUM = 1024
"""``auto`` budgets are whole multiples of this many tokens."""
MIN_AUTO_BUDGET = 256
"""Below this many forward tokens a micro-batch no longer holds a completion of real length."""
MAX_AUTO_BUDGET = {"cpu": 4096, "cuda": 65536}
"""More tokens per micro-batch than this no longer pay: on CPU cores the matmuls are saturated by
about 2k tokens (benchmarks/memory.py: seconds per token flat from one 8-row group up), so a larger
budget would only hold more memory; on a GPU larger micro-batches keep the card busy."""
SAMPLE_ROWS_GUESS = 64
"""Rows the sampler decodes at once when the step's size is not known."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory price needs of a causal LM (from its config; no weights loaded)."""

    params: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any, params: int, trainable: int | None = None) -> ModelShape:
        """From a transformers config (GPT-2's names too) and a parameter count."""
        def get(*names: str, default: int = 0) -> int:
            for n in names:
                v = getattr(config, n, None)
                if isinstance(v, int) and v > 0:
                    return v
            return default

        hidden = get("hidden_size", "n_embd", "d_model", default=1)
        heads = get("num_attention_heads", "n_head", default=1)
        return cls(params=params, trainable=params if trainable is None else trainable,
                   layers=get("num_hidden_layers", "n_layer", default=1), hidden=hidden,
                   intermediate=get("intermediate_size", "n_inner", default=4 * hidden), heads=heads,
                   kv_heads=get("num_key_value_heads", default=heads),
                   head_dim=get("head_dim", default=max(1, hidden // heads)), vocab=get("vocab_size", default=1))

    @classmethod
    def of_model(cls, model: Any) -> ModelShape:
        """From a loaded model (LoRA: the adapter's parameters are the trainable ones)."""
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return cls.from_config(model.config, params, trainable)

    def activation_prior(self, checkpointing: bool = False) -> float:
        """Bytes per forward token of a training forward kept for the backward (fp32), before any
        measurement: per layer ~6 hidden-wide, 3 MLP-wide and one attention-row (heads x 128)
        vectors; under gradient checkpointing one hidden vector per layer plus one layer's worth."""
        per_layer = 6 * self.hidden + 3 * self.intermediate + 128 * self.heads
        if checkpointing:
            return FP32 * (self.layers * self.hidden + 2 * per_layer)
        return FP32 * self.layers * per_layer

    def kv_bytes_per_token(self) -> float:
        """The sampler's KV cache per token (fp32 keys and values of every layer)."""
        return FP32 * 2 * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class MemoryPrice:
    """One policy worker's bytes (see the module doc); every field in bytes."""

    process: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    sampler: int
    head_chunk: int
    act_bytes_per_token: float
    act_measured: bool
    """Whether ``act_bytes_per_token`` was measured (else the shape's prior)."""
    max_budget: int = MAX_AUTO_BUDGET["cpu"]
    """The largest ``auto`` budget on this kind of device."""

    @property
    def resident(self) -> int:
        """Everything but the activations."""
        return (self.process + self.weights + self.gradients + self.optimizer + self.reference + self.sampler
                + self.head_chunk)

    def peak(self, micro_batch_tokens: int) -> int:
        """The predicted peak with micro-batches of ``micro_batch_tokens`` forward tokens."""
        return int(self.resident + self.act_bytes_per_token * micro_batch_tokens)

    def largest_budget(self, allowance: int) -> int | None:
        """The largest ``auto`` budget whose peak fits ``allowance`` (None: not even the smallest)."""
        room = allowance - self.resident
        tokens = int(room / max(self.act_bytes_per_token, 1.0))
        tokens = min(self.max_budget, tokens // BUDGET_QUANTUM * BUDGET_QUANTUM)
        if tokens < BUDGET_QUANTUM:
            tokens = MIN_AUTO_BUDGET if room >= self.act_bytes_per_token * MIN_AUTO_BUDGET else 0
        return tokens or None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"resident": self.resident}


def price(shape: ModelShape, *, phases: int = 1, beta: float = 0.0, lora: bool = False,
          checkpointing: bool = False, sampler: str = "hf", sample_rows: int = SAMPLE_ROWS_GUESS,
          sample_tokens: int = 512, fsdp_ranks: int = 1, gpu: bool = False, gpu_share: float | None = None,
          gpu_bytes: int | None = None, act_bytes_per_token: float | None = None,
          logits_budget: int = 1 << 25) -> MemoryPrice:
    """The memory price of one worker of a policy of ``shape``.

    ``phases``: optimizer phases (1 + sharing phases with their own step); ``sampler``: ``hf``
    (KV cache of ``sample_rows`` rows of ``sample_tokens``; on CPU the packed linears copy the
    weights) or ``vllm`` (its share of the card, ``gpu_share`` x ``gpu_bytes``, on a GPU; its KV
    space on CPU); ``fsdp_ranks``: the training state is split over them, the sampler keeps a full
    copy; ``act_bytes_per_token``: a measurement (else the prior)."""
    ranks = max(1, fsdp_ranks)
    weights = shape.params * FP32
    trainable = shape.trainable * FP32
    sharded = weights // ranks
    grads = trainable // ranks
    optim = 2 * trainable * max(1, phases) // ranks
    reference = weights if beta > 0 and not lora else 0
    if sampler == "vllm":
        if gpu:
            samp = int((gpu_share or 0.0) * (gpu_bytes or 0))
        else:
            samp = weights + int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30
    else:
        kv = int(shape.kv_bytes_per_token() * sample_rows * sample_tokens)
        copy = weights if (ranks > 1 or not gpu) else 0  # FSDP's gathered copy; CPU's packed linears
        samp = kv + copy
    head = 3 * FP32 * min(logits_budget, shape.vocab * 4096)
    measured = act_bytes_per_token is not None and act_bytes_per_token > 0
    act = float(act_bytes_per_token) if measured else shape.activation_prior(checkpointing)
    return MemoryPrice(PROCESS_BYTES, sharded, grads, optim, reference, samp, head, act, measured,
                       MAX_AUTO_BUDGET["cuda" if gpu else "cpu"])


def machine_bytes() -> int:
    """The machine's RAM (cgroup limit when lower)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return total


def cpu_allowances(resident: list[int], concurrent: bool, total: int | None = None) -> list[int]:
    """Each policy's bytes on a CPU machine: its resident bytes plus its part of what is left of the
    machine's RAM (less :data:`CPU_HEADROOM`) once every policy's resident bytes are held: the whole
    rest for each when the updates do not overlap (one process, the sequential scheduler), an equal
    part each when they do."""
    pool = int((total or machine_bytes()) * CPU_HEADROOM) - sum(resident)
    part = pool if not concurrent else pool // max(1, len(resident))
    return [r + part for r in resident]


class MemoryPlanError(ValueError):
    """A plan that cannot fit in memory: names the policy, the bytes and the levers."""

    def __init__(self, policy: str, field: str, need: int, have: int, detail: str) -> None:
        self.policy, self.field, self.need, self.have = policy, field, need, have
        super().__init__(
            f"policy {policy!r} does not fit in memory: it needs {gib(need)} at its peak ({detail}) but the plan "
            f"can give it {gib(have)}. Levers: a smaller {field}, peft (LoRA: no full gradients or optimizer "
            f"state), grpo.gradient_checkpointing: true, fsdp: true with more workers (the training state is "
            f"split over the ranks), or a larger machine/GPU.")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_fits(policy: str, price_: MemoryPrice, allowance: int, budget: int | str | None,
               longest_row: int, field: str) -> int | None:
    """The micro-batch budget a worker runs with: ``auto`` resolved to the largest that fits, a fixed
    one checked. Raises :class:`MemoryPlanError` when the resident bytes plus one row's activations
    (``longest_row`` forward tokens, the least a micro-batch holds) do not fit, or a fixed budget's
    peak does not. ``None`` budget: the whole phase at once (not checked: its size is the batch's)."""
    least = price_.peak(longest_row)
    if least > allowance:
        raise MemoryPlanError(policy, field, least, allowance,
                              f"{gib(price_.resident)} resident + one row of {longest_row} tokens")
    if budget == "auto":
        got = price_.largest_budget(allowance)
        return max(got or longest_row, longest_row)
    if isinstance(budget, int):
        need = price_.peak(budget)
        if need > allowance:
            raise MemoryPlanError(policy, field, need, allowance,
                                  f"{gib(price_.resident)} resident + {budget} tokens x "
                                  f"{price_.act_bytes_per_token / 1024:.0f} KiB")
        return budget
    return None
