"""MWRA's memory price: the bytes a policy's worker holds at its peak, and the micro-batch that fits.

A worker's peak is its *resident* bytes plus the larger of its two turns' transients:

* resident: weights (fp32 master copy), gradients of the trainable weights, AdamW's two moments
  per optimizer phase (the policy's own and one per sharing step that asks for its own step), the
  frozen reference copy (``beta > 0`` without LoRA), the sampler's extra copy (packed CPU linears,
  FSDP's gathered one, vLLM's weights on CPU or its share of the card on a GPU), and the process
  itself (Python, torch, the tokenizer, the sampler's buffers);
* sampling: the HF engine's KV cache for the rows it decodes at once (a step's, or an evaluation's);
* an update micro-batch: the LM head's chunk of logits and ``(1 + BACKWARD_EXTRA)`` x activation
  bytes per forward token x the micro-batch's forward tokens (:mod:`mutualrl.algorithms.micro_batch`).
  The bytes per token start from the model's shape (:meth:`ModelShape.activation_prior`) and are
  replaced by autograd's own count once measured (every update reports ``act_bytes_per_token``;
  ``mutualrl plan --calibrate`` folds it in; :func:`measure_activation_bytes` is the probe).

The memory a worker is given: on CPU the machine's RAM less :data:`CPU_HEADROOM`, after every
worker's resident bytes, whole to each policy of one process (the sequential scheduler's update one
after another) or split equally over the processes whose updates overlap; on a GPU the worker's
share of the card, or in one process the card's pool. ``micro_batch_tokens: auto`` takes the
largest budget that fits it, snapped to whole prompt groups (or :data:`BUDGET_QUANTUM` tokens), so
a budget, and with it the update's float rounding, does not move with a few megabytes; on CPU cores
a micro-batch's transient bytes stay under :data:`CPU_ACTIVATION_CAP`. A plan whose resident bytes
and one row do not fit, or whose fixed budget does not, is refused before anything runs
(:class:`MemoryPlanError`, exit 2 through the CLI).
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from mutualrl.errors import UserError

FP32 = 4
CPU_HEADROOM = 0.85
"""Share of the machine's RAM the plan hands out on CPU (the rest: the OS, the exchange, the controller)."""
GPU_HEADROOM = 0.9
"""Share of a card's memory the plan hands out (CUDA contexts and the allocator's slack take the rest)."""
PROCESS_BYTES = 512 * 2**20
"""A worker process beside its model's tensors: Python, torch, transformers, the tokenizer and the
sampler's buffers (SmolLM2-135M on this CPU: ~0.5 GiB)."""
BACKWARD_EXTRA = 0.4
"""The backward holds gradients of activations beside the activations it is consuming: an update
micro-batch's transient peak is (1 + this) x its saved activations (SmolLM2-135M, fp32, CPU:
4.2 GB over 2.8 GB saved for a group of 8 rows of 64 + 256 tokens, the LM head's chunk apart)."""
BUDGET_QUANTUM = 256
"""``auto`` budgets are whole multiples of this many tokens."""
MIN_AUTO_BUDGET = 256
"""Below this many forward tokens a micro-batch no longer holds a completion of real length."""
MAX_AUTO_BUDGET = {"cpu": 65536, "cuda": 65536}
"""The largest ``auto`` budget on each kind of device (tokens)."""
CPU_ACTIVATION_CAP = 6 * 2**30
"""On CPU cores an ``auto`` micro-batch's transient bytes (activations and their gradients) stay under
this: the matmuls are saturated well before (benchmarks/memory.py: SmolLM2's seconds per token are
no lower at 64 rows than in one 8-row group of 64 + 256 tokens), so a larger micro-batch would only
hold memory. Small models (the zoo) still train a whole step in one forward."""
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
        """Bytes per forward token a training forward keeps for its backward (fp32), before any
        measurement. Per layer: ~5 hidden-wide vectors (norms, residual inputs), 4 query-wide ones
        (queries before and after RoPE, attention output, the output projection's input), 2.5
        query-wide for the keys and values that grouped-query attention repeats per head (the shared
        prompt's among them), and 4 MLP-wide ones (gate, up, their activation and product). Within
        ~20 % of autograd's own count (:func:`measure_activation_bytes`) on SmolLM2-135M (+17 %) and
        Gemma-3-270M (-11 %). Under gradient checkpointing: one hidden vector per layer plus one
        layer's worth."""
        if checkpointing:
            return FP32 * self.layers * self.hidden + self.recompute_prior()
        return FP32 * self.layers * self._per_layer()

    def _per_layer(self) -> float:
        q = self.heads * self.head_dim
        return 5 * self.hidden + 6.5 * q + 4 * self.intermediate

    def recompute_prior(self) -> float:
        """Under gradient checkpointing, the bytes per token of the layer being recomputed in the
        backward (and its gradients): two layers' worth."""
        return FP32 * 2 * self._per_layer()

    def kv_bytes_per_token(self) -> float:
        """The sampler's KV cache per token (fp32 keys and values of every layer)."""
        return FP32 * 2 * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class MemoryPrice:
    """One policy worker's bytes (see the module doc); every field in bytes. Sampling and the update
    take turns: the peak is the resident bytes plus the larger of the sampler's KV cache and an
    update micro-batch's transient bytes (its activations and the LM head's chunk)."""

    process: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    sampler_copy: int
    """A second copy of the weights the sampler reads (CPU packed linears, FSDP's gathered copy,
    vLLM's own weights on CPU; a vLLM share of the card on a GPU)."""
    sampler_kv: int
    head_chunk: int
    act_bytes_per_token: float
    act_measured: bool
    """Whether ``act_bytes_per_token`` was measured (else the shape's prior)."""
    max_budget: int = MAX_AUTO_BUDGET["cpu"]
    """The largest ``auto`` budget on this kind of device."""
    activation_cap: int | None = CPU_ACTIVATION_CAP
    """The most transient bytes an ``auto`` micro-batch holds (:data:`CPU_ACTIVATION_CAP` on CPU)."""

    @property
    def resident(self) -> int:
        """What the worker holds between phases."""
        return (self.process + self.weights + self.gradients + self.optimizer + self.reference
                + self.sampler_copy)

    def peak(self, micro_batch_tokens: int) -> int:
        """The predicted peak with micro-batches of ``micro_batch_tokens`` forward tokens."""
        update = self.head_chunk + (1 + BACKWARD_EXTRA) * self.act_bytes_per_token * micro_batch_tokens
        return int(self.resident + max(self.sampler_kv, update))

    def largest_budget(self, allowance: int, group_tokens: int | None = None) -> int | None:
        """The largest ``auto`` budget whose peak fits ``allowance`` (None: not even the smallest):
        a whole number of prompt groups of ``group_tokens`` forward tokens where one fits (a budget
        between two multiples would only leave the rest of a group for the next micro-batch), else
        a multiple of :data:`BUDGET_QUANTUM`."""
        if self.resident + self.sampler_kv > allowance:
            return None
        room = allowance - self.resident - self.head_chunk
        if self.activation_cap is not None:
            room = min(room, self.activation_cap)
        tokens = min(self.max_budget, int(room / max((1 + BACKWARD_EXTRA) * self.act_bytes_per_token, 1.0)))
        if group_tokens and tokens >= group_tokens:
            return tokens // group_tokens * group_tokens
        tokens = tokens // BUDGET_QUANTUM * BUDGET_QUANTUM
        if tokens < BUDGET_QUANTUM:
            tokens = MIN_AUTO_BUDGET if room >= self.act_bytes_per_token * MIN_AUTO_BUDGET else 0
        return tokens or None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"resident": self.resident}


def price(shape: ModelShape, *, phases: int = 1, beta: float = 0.0, lora: bool = False,
          checkpointing: bool = False, sampler: str = "hf", sample_rows: int = SAMPLE_ROWS_GUESS,
          sample_tokens: int = 512, fsdp_ranks: int = 1, gpu: bool = False, gpu_share: float | None = None,
          gpu_bytes: int | None = None, act_bytes_per_token: float | None = None,
          logits_budget: int = 1 << 25, packed_weights: bool = True, bf16: bool = False,
          vllm_bytes: int | None = None) -> MemoryPrice:
    """The memory price of one worker of a policy of ``shape``.

    ``phases``: optimizer phases (1 + sharing phases with their own step); ``sampler``: ``hf``
    (KV cache of ``sample_rows`` rows of ``sample_tokens``; on CPU the packed linears copy the
    weights) or ``vllm`` (its share of the card, ``gpu_share`` x ``gpu_bytes``, on a GPU; its weights
    and KV space on CPU); ``fsdp_ranks``: the training state is split over them, the sampler keeps
    a full copy; ``act_bytes_per_token``: a measurement (else the prior); ``bf16``: autocast halves
    the activations and the KV cache (master weights and AdamW stay fp32)."""
    ranks = max(1, fsdp_ranks)
    weights = shape.params * FP32
    trainable = shape.trainable * FP32
    kv = 0
    if sampler == "vllm":
        copy = (vllm_bytes if vllm_bytes is not None else vllm_need(shape, sample_rows, sample_tokens)) if gpu \
            else weights + int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30
    else:
        kv = int(shape.kv_bytes_per_token() * sample_rows * sample_tokens * (0.5 if bf16 else 1.0))
        copy = weights if (ranks > 1 or (not gpu and packed_weights)) else 0
    measured = act_bytes_per_token is not None and act_bytes_per_token > 0
    scale = 0.5 if bf16 else 1.0
    act = float(act_bytes_per_token) if measured else shape.activation_prior(checkpointing) * scale
    if measured and checkpointing:  # autograd saw the checkpoints only: add the layer being recomputed
        act += shape.recompute_prior() * scale
    return MemoryPrice(process=PROCESS_BYTES, weights=weights // ranks, gradients=trainable // ranks,
                       optimizer=2 * trainable * max(1, phases) // ranks,
                       reference=weights // ranks if beta > 0 and not lora else 0, sampler_copy=copy, sampler_kv=kv,
                       head_chunk=3 * FP32 * min(logits_budget, shape.vocab * 4096), act_bytes_per_token=act,
                       act_measured=measured, max_budget=MAX_AUTO_BUDGET["cuda" if gpu else "cpu"],
                       activation_cap=None if gpu else CPU_ACTIVATION_CAP)


def vllm_need(shape: ModelShape, rows: int, tokens: int) -> int:
    """The least a vLLM engine on a GPU needs: its bf16 weights and a bf16 KV cache for ``rows`` rows
    of ``tokens`` (vLLM allocates its KV space up front, and samples every row of a step at once)."""
    return int(shape.params * 2 + shape.kv_bytes_per_token() / 2 * rows * tokens)


CGROUP = Path("/sys/fs/cgroup")
"""Where a cgroup's memory files are (v2 at its root, v1 under ``memory/``)."""
MEMINFO = Path("/proc/meminfo")


def physical_bytes() -> int:
    """The machine's physical RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_bytes(cgroup: Path = CGROUP) -> int:
    """The machine's RAM (cgroup limit when lower)."""
    total = physical_bytes()
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return total


def available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """What this machine can still give without swapping (``MemAvailable``; less, where a cgroup limit
    below the physical RAM leaves less: its limit minus its usage, reclaimable page cache not counted
    as used); None where neither can be read (not Linux)."""
    have: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    physical = physical_bytes()
    for limit_file, usage_file, stat_file, cache_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):  # cgroup v1
        try:
            limit = (cgroup / limit_file).read_text().strip()
            if not limit.isdigit() or int(limit) >= physical:  # "max", or no lower than the machine's
                continue
            used = int((cgroup / usage_file).read_text().strip())
            stat = dict(line.split() for line in (cgroup / stat_file).read_text().splitlines() if line.count(" ") == 1)
            used -= int(stat.get(cache_key, 0))  # page cache the kernel reclaims before it kills anything
            have.append(int(limit) - used)
        except (OSError, ValueError):
            continue
    return min(have) if have else None


def cpu_allowances(resident: list[int], concurrent: bool, total: int | None = None,
                   headroom: float = CPU_HEADROOM) -> list[int]:
    """Each policy's bytes on a CPU machine (or one process's GPU): its resident bytes plus its part
    of what is left of ``total`` (the machine's RAM; less ``headroom``) once every policy's resident
    bytes are held: the whole rest for each when the updates do not overlap (one process, the
    sequential scheduler), an equal part each when they do."""
    pool = int((total or machine_bytes()) * headroom) - sum(resident)
    part = pool if not concurrent else pool // max(1, len(resident))
    return [r + part for r in resident]


STATE_LEVERS = ("peft (LoRA: no full gradients or optimizer state), fsdp: true with more workers (the "
                "training state is split over the ranks), fewer optimizer phases (a sharing step without a "
                "learning_rate of its own trains in the policy's step)")
"""What shrinks a policy's resident training state."""


class MemoryPlanError(UserError):
    """A plan that cannot fit in memory: names the policy, the bytes and the levers."""

    def __init__(self, policy: str, field: str, need: int, have: int, detail: str, levers: str = "") -> None:
        self.policy, self.field, self.need, self.have = policy, field, need, have
        levers = levers or f"a smaller {field}, {STATE_LEVERS}, grpo.gradient_checkpointing: true"
        super().__init__(
            f"policy {policy!r} ({field.split('.')[0]}) does not fit in memory: it needs {gib(need)} at its peak ({detail}) but the plan "
            f"can give it {gib(have)}. Levers: {levers}, or a larger machine/GPU.")


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def check_fits(policy: str, price_: MemoryPrice, allowance: int, budget: int | str | None,
               longest_row: int, field: str, group_tokens: int | None = None) -> int | None:
    """The micro-batch budget a worker runs with: ``auto`` resolved to the largest that fits, a fixed
    one checked. Raises :class:`MemoryPlanError` when the resident bytes plus one row's activations
    (``longest_row`` forward tokens, the least a micro-batch holds) or the sampler's KV cache do not
    fit, or a fixed budget's peak does not; the levers named are the ones that would help.
    ``None`` budget: the whole phase at once (not checked: its size is the batch's)."""
    least = price_.peak(longest_row)
    if least > allowance:
        kv_bound = price_.sampler_kv > price_.head_chunk + price_.act_bytes_per_token * longest_row
        kv_levers = (f"fewer rows sampled at once (prompts_per_step x num_generations, or eval_batch_size: "
                     f"{gib(price_.sampler_kv)} of KV cache), a shorter max_completion_length")
        if price_.resident > allowance:  # the training state alone is too large
            levers = f"{STATE_LEVERS}" + (f", {kv_levers}" if kv_bound else "")
        elif kv_bound:
            levers = f"{kv_levers}, {STATE_LEVERS}"
        else:
            levers = f"{STATE_LEVERS}, grpo.gradient_checkpointing: true, a shorter max_completion_length"
        raise MemoryPlanError(policy, field, least, allowance,
                              f"{gib(price_.resident)} resident + one row of {longest_row} tokens, or the "
                              f"sampler's {gib(price_.sampler_kv)} of KV cache", levers)
    if budget == "auto":
        got = price_.largest_budget(allowance, group_tokens)
        return max(got or longest_row, longest_row)
    if isinstance(budget, int):
        need = price_.peak(budget)
        if need > allowance:
            raise MemoryPlanError(policy, field, need, allowance,
                                  f"{gib(price_.resident)} resident + {budget} tokens x "
                                  f"{price_.act_bytes_per_token / 1024:.0f} KiB",
                                  f"a smaller {field} (or auto: the largest that fits), "
                                  f"grpo.gradient_checkpointing: true, {STATE_LEVERS}")
        return budget
    return None


# ----------------------------------------------------------------------------- measuring
def _status_bytes(key: str, pid: int | str = "self") -> int:
    """A size from ``/proc/<pid>/status`` (OSError where it cannot be read, KeyError where it lacks
    ``key``: a zombie has no resident set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"no {key} in /proc/{pid}/status")


def process_peak_bytes() -> int:
    """This process's peak resident set (``VmHWM``; ``ru_maxrss`` where there is no /proc)."""
    try:
        return _status_bytes("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_tree_rss(pid: int) -> int | None:
    """The resident bytes of process ``pid`` and every process below it (``VmRSS`` from ``/proc``); None
    where ``pid`` cannot be read (gone, or not Linux). A child that ends while it is read counts 0."""
    total, seen, todo = 0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            total += _status_bytes("VmRSS", p)
        except KeyError:  # no resident set (a zombie): nothing held
            pass
        except OSError:
            if p == pid:
                return None
            continue
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            pass
    return total


def reset_process_peak() -> bool:
    """Start this process's peak resident set afresh at its current size (Linux ``clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class SavedBytes:
    """Within the block, the bytes of the tensors autograd saves for the backward (each storage once,
    the module's parameters left out): what a training forward holds until its backward."""

    def __init__(self, module: Any) -> None:
        self._weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._seen: dict[int, int] = {}
        self._ctx: Any = None

    @property
    def total(self) -> int:
        return sum(self._seen.values())

    def _pack(self, t: Any) -> Any:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._weights and t.device.type != "meta":
            self._seen[ptr] = max(self._seen.get(ptr, 0), st.nbytes())
        # a detached alias of the same storage: the tensor itself would make a saved output hold its
        # own graph (a cycle autograd frees only in a backward: a forward without one would leak it)
        return t.detach()

    def __enter__(self) -> Self:
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def measure_activation_bytes(policy: Any, prompt_len: int, completion_len: int, rows: tuple[int, int] = (2, 4)
                             ) -> float:
    """Bytes per forward token an update's forward keeps for its backward, measured on ``policy``:
    two probes of one prompt with ``rows`` completions of the given lengths (random tokens), each a
    training forward of :meth:`~mutualrl.rollout.policy.Policy.logprobs` whose saved tensors autograd
    reports (``saved_tensors_hooks``; every storage counted once, the weights left out); the slope
    of the two totals over their forward tokens. Deterministic and the same on every device; no
    backward is run and no gradient is left."""
    import torch

    vocab = min(len(policy.tokenizer), policy.model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()

    def probe(n: int) -> tuple[int, int]:
        comps = [torch.randint(3, vocab, (completion_len,), generator=gen).tolist() for _ in range(n)]
        with SavedBytes(policy.model) as saved:
            out = policy.logprobs([prompt] * n, comps)
        del out
        return n * completion_len + prompt_len, saved.total

    was = policy.model.training
    policy.model.train()
    (t1, b1), (t2, b2) = probe(rows[0]), probe(rows[1])
    policy.model.train(was)
    return max(1.0, (b2 - b1) / (t2 - t1))


def group_tokens(num_generations: int, max_completion_length: int) -> int:
    """The forward tokens of one prompt group at its longest: a prompt (allowing
    :data:`PROMPT_TOKENS_GROUP` tokens) and ``num_generations`` completions of the longest length."""
    return PROMPT_TOKENS_GROUP + num_generations * max_completion_length


PROMPT_TOKENS_GROUP = 128
"""The prompt length an ``auto`` budget leaves room for when it snaps to whole groups."""
