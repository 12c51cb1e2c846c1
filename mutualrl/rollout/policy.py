"""A policy: a Hugging Face causal LM, its tokenizer, its optimizer, its sampler (and a reference).

Token-level tensors for training use a *right-aligned* layout ``[B, C]``: the completion of row
``i`` occupies its last ``len_i`` columns. Log-probs are computed from the decoder's hidden
states at completion positions only, and the LM head runs over them in chunks bounded by
``logits_budget`` elements (recomputed in the backward pass when there is more than one chunk),
so a large vocabulary (Gemma-3's 262k) never materialises a ``B x T x V`` logits tensor.

Options users know from TRL/peft: ``gradient_checkpointing``; LoRA through ``peft`` (only the
adapter trains and is checkpointed; with ``beta > 0`` the reference log-probs come from the base
model with the adapter disabled, not from a second copy); ``dtype`` (``auto``: bf16 autocast on a
CUDA device that supports it, fp32 elsewhere); ``device``.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from mutualrl.algorithms.registry import POLICY_PHASE
from mutualrl.allocation.memory import (
    CPU_HEADROOM,
    GPU_HEADROOM,
    MIN_AUTO_BUDGET,
    ModelShape,
    group_tokens,
    machine_bytes,
)
from mutualrl.allocation.memory import price as memory_price
from mutualrl.config import GenerationConfig, GRPOOptions, PeftConfig
from mutualrl.rollout.engines.base import (
    GenerationEngine,
    SamplingParams,
    cache_kwarg,
    dedupe_prompts,
    left_pad,
)
from mutualrl.rollout.engines.head import HEAD_BLOCK_COLUMNS, decoder_and_head
from mutualrl.rollout.engines.hf import HFEngine
from mutualrl.rollout.engines.vllm import VLLMEngine
from mutualrl.rollout.loading import load_lm
from mutualrl.rollout.modeling import format_prompt, tokenizer_fingerprint
from mutualrl.rollout.token_tensors import LOGITS_BUDGET, head_logprobs
from mutualrl.run.devices import cpu_has_native_bf16, resolve_dtype
from mutualrl.run.fsdp import ShardedWeights
from mutualrl.thl.retokenize import encode_completion


@dataclass
class Sample:
    """One sampled completion and its behavior trace."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    """Sampled tokens, EOS included when generation stopped on it."""
    text: str
    """Decoded completion text (special tokens removed)."""
    logprobs: list[float]
    """Behavior log-prob of each sampled token under the sampling distribution."""
    finished: bool


class Policy:
    """A trainable causal LM with its tokenizer, optimizer, sampler and optional reference.

    Args:
        name: the policy's name (its source id in the exchange).
        model_path: a local directory or hub id for ``from_pretrained``.
        options: GRPO options (sampling, optimizer, dtype, gradient checkpointing).
        prompt_template: a format string with ``{question}`` or ``"chat"``.
        seed: seeds the sampling generator.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        peft: LoRA settings (only the adapter trains).
        generation: the sampling engine (``hf`` default, ``vllm``).
        vllm_memory_fraction: a vLLM engine's share of its GPU, as the MWRA plan derived it.
    """

    share_prompt_prefix: bool = True
    """Run a prompt shared by several rows (a GRPO group) through the model once, in sampling and
    in :meth:`logprobs`, and reuse its KV cache for every row (same values, less work)."""

    @property
    def trains_on_shared_prompts(self) -> bool:
        """Whether a training forward runs each distinct prompt once (not under gradient
        checkpointing or FSDP, whose forwards take every row whole)."""
        return self.share_prompt_prefix and not self.options.gradient_checkpointing and self.fsdp is None

    def __init__(self, name: str, model_path: str, options: GRPOOptions, *,
                 prompt_template: str = "{question} Answer: ", system_prompt: str | None = None,
                 seed: int = 0, device: str = "cpu", peft: PeftConfig | None = None,
                 generation: GenerationConfig | None = None, vllm_memory_fraction: float | None = None) -> None:
        self.name = name
        self.model_path = model_path
        self.options = options
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt
        self.device = torch.device("cuda:0" if device == "cuda" else device)
        self.compute_dtype = resolve_dtype(options.dtype, str(self.device))
        if self.compute_dtype == "bfloat16" and self.device.type == "cpu" and not cpu_has_native_bf16():
            warnings.warn("dtype: bfloat16 on a CPU without native bf16 matmuls (no avx512_bf16/amx_bf16): "
                          "bf16 autocast is emulated there and much slower than float32 "
                          "(see docs/performance.md)", RuntimeWarning, stacklevel=2)
        self.tokenizer, model, self.eos_ids, self.pad_id = load_lm(
            model_path, self.device, gradient_checkpointing=options.gradient_checkpointing, peft=peft, name=name,
            engine=generation.engine if generation else "hf")
        self.lora = peft is not None
        self.model = model
        self.sampler_model: torch.nn.Module = model
        """The weights the sampler reads: the model itself, or under FSDP its gathered full copy."""
        self.fsdp: ShardedWeights | None = None
        """The FSDP state once :meth:`shard` ran (``policies[i].fsdp``)."""
        self.ref_model = _frozen_copy(model) if options.beta > 0 and not self.lora else None
        self.optimizers: dict[str, torch.optim.Optimizer] = {POLICY_PHASE: self._adamw(options.learning_rate)}
        """One AdamW per optimizer phase: the policy's own (``policy``) and one per phase a sharing
        step asks for (:meth:`add_optimizer`), each with its own state."""
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.logits_budget = LOGITS_BUDGET
        self.micro_batch_tokens: int | None = None
        """Forward tokens per micro-batch of an update (None: a phase in one forward); ``auto`` is
        resolved here against the machine, and by the plan's memory share in a worker
        (:meth:`fit_micro_batches`)."""
        self.generation = generation or GenerationConfig()
        self.vllm_memory_fraction = vllm_memory_fraction
        """A vLLM engine's share of the GPU the plan derived (None: ``generation.gpu_memory_utilization``)."""
        mbt = options.micro_batch_tokens
        if isinstance(mbt, int):
            self.micro_batch_tokens = mbt
        elif mbt == "auto":
            self.fit_micro_batches()
        self.engine: GenerationEngine = self._make_engine()

    def _make_engine(self) -> GenerationEngine:
        if self.generation.engine == "vllm":
            return VLLMEngine(self)

        # the blocked LM head pays on CPU; under autocast the model's own head keeps its dtype handling
        block = HEAD_BLOCK_COLUMNS if self.device.type == "cpu" and self.compute_dtype != "bfloat16" else None
        return HFEngine(self.sampler_model, self.eos_ids, self.pad_id, self.generator, autocast=self._autocast,
                        share_prompt_prefix=self.share_prompt_prefix, head_block=block,
                        pack_linears=block is not None and self.generation.packed_weights,
                        lean_step=self.generation.lean_decoding)

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                 weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                                 **_adamw_impl(self.device, sharded=self.fsdp is not None))

    def shard(self) -> None:
        """Shard the trainable weights, gradients and optimizer states over the policy's ranks with
        FSDP2 (:mod:`mutualrl.run.fsdp`). Every rank calls it once, after the process group is up and the
        ranks hold the same weights, before a sharing step adds optimizers of its own."""
        if self.fsdp is not None or len(self.optimizers) > 1:
            raise RuntimeError(f"policy {self.name!r}: shard() runs once, before further optimizers are added")
        self.fsdp = ShardedWeights(self.model, self._plain_forward, self.ref_model)
        self.sampler_model = self.fsdp.full
        self.optimizers = {POLICY_PHASE: self._adamw(self.options.learning_rate)}
        if isinstance(self.engine, HFEngine):  # the HF loop reads the model it was built on: the copy now
            self.engine.close()
            self.engine = self._make_engine()
        else:  # vLLM reads sampler_model at every sync (a second engine in one process may not fit)
            self.engine.sync_weights()

    def fit_micro_batches(self, allowance: int | None = None, phases: int | None = None,
                          act_bytes_per_token: float | None = None) -> int | None:
        """Set ``micro_batch_tokens`` (when the options ask for ``auto``) to the largest budget whose
        predicted peak (:mod:`mutualrl.allocation.memory`) fits ``allowance`` bytes (default: this
        machine's RAM, or the device's memory, less headroom); returns the budget."""
        if self.options.micro_batch_tokens != "auto":
            return self.micro_batch_tokens
        gpu = self.device.type == "cuda"
        if allowance is None:
            allowance = (int(torch.cuda.get_device_properties(self.device).total_memory * GPU_HEADROOM)
                         if gpu else int(machine_bytes() * CPU_HEADROOM))
        price = memory_price(ModelShape.of_model(self.model), phases=phases or len(self.optimizers),
                             beta=self.options.beta, lora=self.lora, gpu=gpu,
                             checkpointing=self.options.gradient_checkpointing,
                             act_bytes_per_token=act_bytes_per_token, sampler=self.generation.engine,
                             logits_budget=self.logits_budget)
        group = group_tokens(self.options.num_generations, self.options.max_completion_length)
        self.micro_batch_tokens = price.largest_budget(allowance, group) or MIN_AUTO_BUDGET
        return self.micro_batch_tokens

    @property
    def full_weights(self) -> torch.nn.Module:
        """A module holding the full current weights (what a checkpoint or an export writes): the
        model, or under FSDP the sampler's copy, gathered after every optimizer step."""
        return self.sampler_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The policy's own optimizer (the GRPO step)."""
        return self.optimizers[POLICY_PHASE]

    def add_optimizer(self, phase: str, lr: float) -> torch.optim.Optimizer:
        """A further AdamW over the same trainable weights for optimizer phase ``phase`` (a sharing
        step's own step at ``lr``, e.g. a supervised step on rescue rows); made once, at set-up."""
        if phase in self.optimizers:
            raise ValueError(f"policy {self.name!r} already has an optimizer for phase {phase!r}")
        self.optimizers[phase] = self._adamw(lr)
        return self.optimizers[phase]

    def optimizer_for(self, phase: str) -> torch.optim.Optimizer:
        """The optimizer of ``phase`` (``KeyError`` naming the phases there are)."""
        try:
            return self.optimizers[phase]
        except KeyError:
            raise KeyError(f"policy {self.name!r} has no optimizer for phase {phase!r} (phases: "
                           f"{', '.join(self.optimizers)}); a strategy's phases are added when its worker starts") from None

    def set_learning_rate(self, lr: float) -> None:
        """Use ``lr`` for the next optimizer steps (the schedule is computed by the caller)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def sync_engine(self) -> float:
        """After an optimizer step: make the sampler use the new weights (under FSDP, gathered into its
        copy first: every rank calls it); returns the seconds taken."""
        t0 = time.perf_counter()
        if self.fsdp is not None:
            self.fsdp.gather()
        gathered = time.perf_counter() - t0
        return gathered + self.engine.sync_weights()

    # ------------------------------------------------------------------ prompts
    @property
    def tokenizer_id(self) -> str:
        """A short id of the tokenizer (its class, vocabulary size and a content hash)."""
        if not hasattr(self, "_tok_id"):
            self._tok_id = tokenizer_fingerprint(self.tokenizer)
        return self._tok_id

    def format_prompt(self, question: str) -> str:
        """The prompt text for ``question`` (template or chat template)."""
        return format_prompt(self.prompt_template, self.system_prompt, self.tokenizer, question)

    def encode_prompt(self, question: str) -> list[int]:
        """Token ids of the prompt for ``question`` (BOS per the tokenizer; no EOS)."""
        text = self.format_prompt(question)
        add_special = self.prompt_template != "chat"
        ids = self.tokenizer(text, add_special_tokens=add_special)["input_ids"]
        while ids and ids[-1] in self.eos_ids:  # some post-processors append EOS; a prompt must not end
            ids = ids[:-1]
        if not ids:
            raise ValueError(f"the prompt {text[:60]!r} encodes to no tokens with the tokenizer of "
                             f"{self.model_path!r}; check prompt_template and the tokenizer files")
        return list(ids)

    def encode_completion(self, prompt_ids: Sequence[int] | None, text: str, add_eos: bool = True) -> list[int]:
        """Token ids of a completion text as this policy would emit it after ``prompt_ids`` (EOS
        appended). With a prompt, THL's prompt-aware encoding is used: SentencePiece-style
        tokenizers mark a standalone string's first word differently from a continuation."""
        if prompt_ids:
            ids = list(encode_completion(self.tokenizer, list(prompt_ids), text)[0])
        else:
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if add_eos:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ generation
    def _left_pad(self, seqs: Sequence[Sequence[int]], min_width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return left_pad(seqs, self.pad_id, self.device, min_width)

    def sampling_params(self, *, greedy: bool = False, max_new_tokens: int | None = None) -> SamplingParams:
        """This policy's sampling settings (``max_completion_length``, ``temperature``, ``top_p``)."""
        o = self.options
        return SamplingParams(max_new_tokens or o.max_completion_length, o.temperature, o.top_p, greedy)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], *, greedy: bool = False,
                     max_new_tokens: int | None = None) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """Sample one completion per prompt. Returns ids, behavior log-probs, finished."""
        g = self.engine.generate(prompt_ids, 1, self.sampling_params(greedy=greedy, max_new_tokens=max_new_tokens))
        return g.ids, g.logprobs, g.finished

    def generate(self, questions: Sequence[str], num_generations: int | None = None, *,
                 greedy: bool = False, batch_size: int | None = None) -> list[Sample]:
        """Sample ``num_generations`` completions per question (grouped: prompt-major order);
        at most ``batch_size`` completions go through the engine at once."""
        g = 1 if greedy else (num_generations or self.options.num_generations)
        prompts = [self.encode_prompt(q) for q in questions]
        per_call = max(1, (batch_size or len(prompts) * g) // g)
        params = self.sampling_params(greedy=greedy)
        samples: list[Sample] = []
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start:start + per_call]
            out = self.engine.generate(chunk, g, params)
            for k, (c, lp, f) in enumerate(zip(out.ids, out.logprobs, out.finished, strict=True)):
                i = start + k // g
                text = self.tokenizer.decode(c, skip_special_tokens=True)
                samples.append(Sample(i, prompts[i], c, text, lp, f))
        return samples

    # ------------------------------------------------------------------ training-side log-probs
    def _parts(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(decoder, LM head) of ``model`` (through a peft wrapper)."""
        return decoder_and_head(model)

    def _head_logprobs(self, head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        return head_logprobs(head, hidden, targets, self.options.temperature, self.logits_budget, softcap)

    def _forward_logprobs(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                          completion_ids: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        if self.fsdp is not None:  # one forward of the root unit: the same collectives on every rank
            return self.fsdp.root_for(model)(prompt_ids, completion_ids, width)
        uniq, inv = dedupe_prompts(prompt_ids)
        if (self.trains_on_shared_prompts and len(uniq) < len(prompt_ids)
                and max(len(c) for c in completion_ids) <= width):
            return self._forward_logprobs_shared(model, uniq, inv, completion_ids, width)
        return self._plain_forward(model, prompt_ids, completion_ids, width)

    def _plain_forward(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                       completion_ids: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        """Every row through the decoder in one call (prompt and completion together)."""
        decoder, head = self._parts(model)
        seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        # at least width + 1 columns, so the last width + 1 positions exist even when every sequence is
        # shorter than the requested width (e.g. short rescue rows packed to a batch's width)
        ids, mask = self._left_pad(seqs, min_width=width + 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with self._autocast():
            hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
            return self._head_logprobs(head, hidden[:, -width - 1:-1], ids[:, -width:])

    def _forward_logprobs_shared(self, model: torch.nn.Module, uniq: list[list[int]], inv: list[int],
                                 completion_ids: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        """:meth:`_forward_logprobs` for rows that share prompts (a GRPO group): each distinct prompt
        runs through the model once, its KV cache is indexed out to its rows, and only the
        completions run per row. Same values and gradients (the prompt's gradient is the sum over
        its rows), about ``prompt / (prompt + completion) * (1 - 1/G)`` less forward and backward
        work. Completions are left-aligned after the cached prompt, then laid out right-aligned."""
        dev = self.device
        decoder, head = self._parts(model)
        b = len(completion_ids)
        lens = torch.tensor([len(c) for c in completion_ids], device=dev)
        cmax = max(1, int(lens.max()))
        p_ids, p_mask = self._left_pad(uniq)
        p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
        rows = torch.tensor(inv, device=dev)
        c_ids = torch.full((b, cmax), self.pad_id, dtype=torch.long)
        c_mask = torch.zeros((b, cmax), dtype=torch.long)
        for i, c in enumerate(completion_ids):
            if c:
                c_ids[i, :len(c)] = torch.as_tensor(list(c))
                c_mask[i, :len(c)] = 1
        c_ids, c_mask = c_ids.to(dev), c_mask.to(dev)
        cache_kw = cache_kwarg(decoder)
        with self._autocast():
            out = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True)
            # the prompt's last position predicts each row's first completion token
            first = out.last_hidden_state[:, -1:][rows]
            if cmax > 1:
                cache = getattr(out, cache_kw)
                cache.batch_select_indices(rows)
                mask = torch.cat([p_mask[rows], c_mask], dim=1)
                pos = p_mask.sum(-1, keepdim=True)[rows] + torch.arange(cmax, device=dev).unsqueeze(0)
                out2 = decoder(input_ids=c_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                               **{cache_kw: cache})
                # position j predicts completion token j + 1
                hidden = torch.cat([first, out2.last_hidden_state[:, :-1]], dim=1)
            else:
                hidden = first
            left = self._head_logprobs(head, hidden, c_ids)  # [B, cmax], token j in column j
        j = torch.arange(width, device=dev).unsqueeze(0) - (width - lens).unsqueeze(1)
        valid = j >= 0
        right = left.gather(1, j.clamp(min=0, max=cmax - 1))
        return torch.where(valid, right, torch.zeros_like(right))

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        if self.ref_model is not None:
            yield self.ref_model
        elif self.lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            raise RuntimeError("no reference model: beta == 0")

    def logprobs(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                 width: int | None = None, *, reference: bool = False, local: bool = False) -> torch.Tensor:
        """Per-token log-probs ``[B, C]`` (right-aligned) of the completions under current weights.

        Scaled by the sampling temperature, like the behavior log-probs from :meth:`generate`.
        Gradients flow unless called under ``torch.no_grad``. ``reference=True`` uses the frozen
        reference (the base model with the adapter off, under LoRA; no gradient). ``local=True``: a
        forward this rank runs alone (scoring; under FSDP the gathered copy, no gradient).
        """
        c = width or max(1, max(len(x) for x in completion_ids))
        if local and self.fsdp is not None:  # the gathered full copy: no collective, any number of forwards
            with torch.no_grad():
                return self._plain_forward(self.fsdp.full, prompt_ids, completion_ids, c)
        if reference:
            with torch.no_grad(), self._reference() as ref:
                return self._forward_logprobs(ref, prompt_ids, completion_ids, c)
        return self._forward_logprobs(self.model, prompt_ids, completion_ids, c)

    # ------------------------------------------------------------------ persistence
    def checkpoint_keys(self) -> list[str] | None:
        """State-dict keys a checkpoint holds: ``None`` for every key (full fine-tuning), or the
        adapter's keys under LoRA (the base weights come from ``model_path`` again)."""
        if not self.lora:
            return None
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        return [k for k, v in self.model.state_dict(keep_vars=True).items() if id(v) in trainable]

    def trainable_parameter_count(self) -> int:
        """Parameters the optimizer updates (the adapter's alone under LoRA)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def parameter_count(self) -> int:
        """All parameters of the model, frozen ones included."""
        return sum(p.numel() for p in self.model.parameters())

    def close(self) -> None:
        """Shut the sampling engine down."""
        self.engine.close()


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode that no gradient reaches (the KL reference)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _adamw_impl(device: torch.device, sharded: bool = False) -> dict[str, bool]:
    """AdamW's fused kernel where this torch has one for ``device`` (one pass over each parameter
    instead of a dozen foreach sweeps: ~4x faster steps on CPU), else the foreach default (and for
    FSDP's DTensor shards)."""
    if device.type in ("cpu", "cuda") and not sharded:
        try:
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))], fused=True)
            return {"fused": True}
        except (RuntimeError, TypeError, ValueError):
            pass
    return {}
