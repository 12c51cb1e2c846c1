"""The default engine: mutualrl's KV-cache sampling loop over a Hugging Face causal LM.

Left-padded prompts; a prompt shared by several rows (a GRPO group) is prefilled once and its
cache indexed out to its rows. Per generated token the loop does one forward of one position, a
log-softmax, a draw from the seeded generator and a few in-place writes into preallocated buffers;
it copies to the host only at the end. With ``head_block`` (the policy sets it on CPU in fp32) the
LM head runs in vocabulary blocks (:mod:`mutualrl.rollout.engines.head`) into a reused buffer, once the
first call has checked that this reproduces the model's own logits. Decoding steps pass the padding
mask as the 4D boolean mask SDPA takes, which transformers uses as it is instead of building one
from the 2D mask at every step (the zoo's 32-token sampling ~15 % faster), where that is the same
mask: SDPA attention, no sliding window shorter than the sequence; the first call checks it too.
With ``pack_linears`` (the policy sets it on CPU in fp32) each sampling call runs through linear
layers prepacked for MKL or oneDNN (:mod:`mutualrl.rollout.engines.packed`), the LM head included, once the
first call has checked that they give the model's own logits. With ``lean_step`` (the policy's
default) decoding steps of GPT-2 and Llama-family models run :mod:`mutualrl.rollout.engines.decode_step`'s
lean step over a static KV cache instead of the model's forward, once the first call has checked
that it gives the model's own logits.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mutualrl.rollout.engines.base import (
    Generation,
    SamplingParams,
    cache_kwarg,
    dedupe_prompts,
    left_pad,
    sample_tokens,
    unwrap_peft,
)
from mutualrl.rollout.engines.decode_step import DecodeStep, StaticKV, decode_step_for
from mutualrl.rollout.engines.head import blockable, blocked_logits, decoder_and_head
from mutualrl.rollout.engines.packed import (
    BACKENDS,
    default_backend,
    packable_linears,
    packed_linears,
    packing_available,
)

CHECK_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
"""(rtol, atol) of the first-call checks by compute dtype. The fp32 pair is absolute; in half
precision ``atol`` is relative to the largest reference logit (bf16 keeps 8 bits: logits near 20
are 0.125 apart, and two correct orders of the same sums land an ulp or two apart)."""

_warned: set[str] = set()


def close_enough(mine: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``mine`` equals ``ref`` (logits) to the rounding of a forward computed in ``dtype``
    (:data:`CHECK_TOLERANCES`; an unknown dtype gets the bf16 ones)."""
    rtol, atol = CHECK_TOLERANCES.get(dtype, CHECK_TOLERANCES[torch.bfloat16])
    if dtype != torch.float32:
        atol *= max(1.0, float(ref.detach().abs().max()))
    return bool(torch.allclose(mine.float(), ref.float(), rtol=rtol, atol=atol))


def check_failed(name: str, mine: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Warn (once per check and process) that the first-call check ``name`` found its fast path
    differs from the model's own forward beyond ``dtype``'s tolerance, so it is off."""
    if name in _warned:
        return
    _warned.add(name)
    diff = float((mine.float() - ref.float()).abs().max())
    warnings.warn(f"HFEngine: the {name} gave logits {diff:.3g} away from the model's own forward "
                  f"(beyond the {str(dtype).removeprefix('torch.')} tolerance of the first-call check); "
                  "sampling goes on without it (slower, same results)", RuntimeWarning, stacklevel=3)


class HFEngine:
    """The default engine: a KV-cache sampling loop over a Hugging Face causal LM.

    Args:
        model: the causal LM (the trainer's own module: there are no weights to sync).
        eos_ids: token ids that end a completion.
        pad_id: id written after a row finished.
        generator: the seeded host generator; on CPU every draw comes from it, on a GPU each call seeds
            a device generator from it (so a checkpointed host generator makes sampling resumable).
        autocast: a context manager factory for the compute dtype (e.g. bf16 autocast).
        share_prompt_prefix: prefill a prompt shared by several rows once.
        head_block: compute the LM head in blocks of this many vocabulary rows (``None``: the
            model's own forward). Used only when the head is a plain linear layer and, checked on
            the first call, the decoder plus the blocked head give the model's logits.
        pack_linears: sample through prepacked linear weights (fp32 CPU; see
            :mod:`mutualrl.rollout.engines.packed`): a backend (``mkl``, ``onednn``) or ``True`` for the CPU's
            default one, where the first call finds they give the model's logits.
        lean_step: decode through :mod:`mutualrl.rollout.engines.decode_step`'s lean step over a static KV
            cache (GPT-2 and Llama-family models), where the first call finds it gives the model's
            logits.
    """

    def __init__(self, model: torch.nn.Module, eos_ids: Iterable[int], pad_id: int, generator: torch.Generator,
                 *, autocast: Any = contextlib.nullcontext, share_prompt_prefix: bool = True,
                 head_block: int | None = None, pack_linears: bool | str = False, lean_step: bool = False) -> None:
        self.model = model
        self.eos_ids = sorted({int(e) for e in eos_ids})
        self.pad_id = int(pad_id)
        self.generator = generator
        self.autocast = autocast
        self.share_prompt_prefix = share_prompt_prefix
        self._cache_kw = cache_kwarg(model)
        self.head_block = head_block
        self.blocked_head: bool | None = None if head_block else False
        """Whether decoding uses the blocked head: ``None`` until the first call has checked it."""
        self._parts: tuple[torch.nn.Module, torch.nn.Module] | None = None
        """(decoder, LM head), taken by that check."""
        self.mask_4d: bool | None = None
        """Whether decoding steps pass a 4D padding mask: ``None`` until the first call has checked it."""
        self.pack_backend: str | None = (default_backend() if pack_linears is True
                                         else pack_linears if pack_linears in BACKENDS else None)
        """The prepacking backend (:data:`~mutualrl.rollout.engines.packed.BACKENDS`), ``None``: plain layers."""
        if pack_linears not in (False, True, *BACKENDS):
            raise ValueError(f"pack_linears: expected true, false or one of {', '.join(BACKENDS)}, got {pack_linears!r}")
        self.packed: bool | None = None if self.pack_backend else False
        """Whether sampling runs through prepacked linear weights: ``None`` until the first call has
        checked it."""
        self._packing = False
        self.lean: bool | None = None if lean_step else False
        """Whether decoding steps run the lean step (:mod:`mutualrl.rollout.engines.decode_step`) over a static
        cache: ``None`` until the first call has checked it."""
        self._step: DecodeStep | None = None

    def _mask_4d_applies(self, length: int) -> bool:
        """Whether a 4D boolean padding mask of ``length`` positions is the mask the model would build:
        SDPA attention and no sliding window or attention chunk shorter than the sequence."""
        cfg = getattr(unwrap_peft(self.model), "config", None)
        if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
            return False
        window = [getattr(cfg, k, None) for k in ("sliding_window", "attention_chunk_size")]
        return all(w is None or length <= w for w in window)

    def _check_mask_4d(self, ids: torch.Tensor, mask2: torch.Tensor, mask4: torch.Tensor, pos: torch.Tensor,
                       past: Any) -> tuple[torch.Tensor, Any]:
        """One decoding step with the 2D mask (its result is used) and the same step, on a copy of the
        cache, with the 4D mask: :attr:`mask_4d` is whether the two give the same logits."""
        logits, past = self._forward(ids, mask2, pos, past, None)
        self.mask_4d = False
        try:
            trial = copy.deepcopy(past)
            trial.crop(-1)  # drop the position just added (a negative count: every transformers version)
            mine, _ = self._forward(ids, mask4, pos, trial, None)
        except (AttributeError, TypeError, RuntimeError, ValueError, IndexError):
            return logits, past
        self.mask_4d = self._agrees("4D padding mask", mine, logits)
        return logits, past

    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward computes in: the autocast dtype where :attr:`autocast` turns autocast
        on for the model's device, else the model's parameters' dtype."""
        dev = self.device.type
        with self.autocast():
            if torch.is_autocast_enabled(dev):
                return torch.get_autocast_dtype(dev)
        return next(self.model.parameters()).dtype

    def _agrees(self, name: str, mine: torch.Tensor, ref: torch.Tensor) -> bool:
        """The outcome of first-call check ``name``: ``mine`` (the fast path's logits) equal to
        ``ref`` (the model's own) within the compute dtype's tolerance (:func:`close_enough`); a
        failure is warned about once (:func:`check_failed`)."""
        dtype = self.compute_dtype()
        if close_enough(mine, ref, dtype):
            return True
        check_failed(name, mine, ref, dtype)
        return False

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, past: Any,
                 buf: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """Logits of the last position (``[B, V]``, fp32) and the cache after one forward."""
        kw = {self._cache_kw: past} if past is not None else {}
        if self.blocked_head and not self._packing:  # a packed head is faster than the blocked one
            with self.autocast():
                out = self._parts[0](input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
            return self._head_logits(out.last_hidden_state[:, -1], buf), getattr(out, self._cache_kw)
        with self.autocast():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=1, **kw)
        return out.logits[:, -1].float(), getattr(out, self._cache_kw)

    def _check_packed(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> bool:
        """Whether the model's last-position logits of one prefill are the same (to float rounding)
        through prepacked linear layers as through its own."""
        backend = self.pack_backend
        if backend is None or not packing_available(backend) or not packable_linears(self.model):
            return False
        kw = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "use_cache": False, "logits_to_keep": 1}
        try:
            with self.autocast():
                plain = self.model(**kw).logits[:, -1].float()
                with packed_linears(self.model, ids.shape[0], backend):
                    mine = self.model(**kw).logits[:, -1].float()
        except (TypeError, AttributeError, RuntimeError, NotImplementedError):
            return False
        return self._agrees("prepacked linear layers", mine, plain)

    def _softcap(self) -> float | None:
        return getattr(getattr(self.model, "config", None), "final_logit_softcapping", None)

    def _check_blocked_head(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                            logits: torch.Tensor) -> None:
        """Decide :attr:`blocked_head` from one prefill: the decoder plus the blocked head must give
        ``logits`` (the model's own) to float rounding, else the model's forward stays."""
        self._parts = decoder_and_head(self.model)
        self.blocked_head = False
        if not blockable(self._parts[1]):
            return
        self.blocked_head = True
        try:
            mine, _ = self._forward(ids, mask, pos, None, None)
        except (TypeError, AttributeError, RuntimeError):
            mine = None
        self.blocked_head = mine is not None and self._agrees("blocked LM head", mine, logits)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sync_weights(self) -> float:
        return 0.0  # samples from the trained module itself

    def close(self) -> None:
        pass

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams) -> Generation:
        rows = [p for p in prompt_ids for _ in range(n)]
        if not rows:
            return Generation([], [], [])
        return self._sample(rows, params)

    @torch.inference_mode()
    def _sample(self, prompt_ids: list[Sequence[int]], params: SamplingParams) -> Generation:
        was_training = self.model.training
        self.model.eval()
        try:
            if self.packed is None:
                ids, mask = left_pad([list(p) for p in prompt_ids[:1]], self.pad_id, self.device)
                self.packed = self._check_packed(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
            with (packed_linears(self.model, len(prompt_ids), self.pack_backend) if self.packed
                  else contextlib.nullcontext()):
                self._packing = self.packed
                return self._sample_loop(prompt_ids, params)
        finally:
            self._packing = False
            if was_training:
                self.model.train()

    def _head_logits(self, hidden: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
        """The LM head over final hidden states ``[B, H]`` (fp32): blocked into ``buf`` where the
        blocked head is on and the layers are not packed, else the head's own forward."""
        if self._parts is None:
            self._parts = decoder_and_head(self.model)
        head = self._parts[1]
        if self.blocked_head and not self._packing:
            logits = blocked_logits(head, hidden.to(head.weight.dtype), self.head_block,
                                    buf if buf is not None and buf.shape[0] == hidden.shape[0] else None,
                                    self._softcap())
        else:
            logits = head(hidden)
            cap = self._softcap()
            if cap:
                logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _lean_applies(self, capacity: int) -> DecodeStep | None:
        """The lean decoding step, where it is on, not ruled out by an earlier check and the model
        has one (:func:`~mutualrl.rollout.engines.decode_step.decode_step_for`)."""
        if self.lean is False:
            return None
        if self._step is None:
            self._step = decode_step_for(self.model)
            if self._step is None:
                self.lean = False
                return None
        window = self._step.window
        return self._step if window is None or capacity <= window else None

    def _sample_loop(self, prompt_ids: list[Sequence[int]], params: SamplingParams) -> Generation:
        dev = self.device
        max_new = params.max_new_tokens
        if self.share_prompt_prefix:
            uniq, inv = dedupe_prompts(prompt_ids)
        else:
            uniq, inv = [list(p) for p in prompt_ids], list(range(len(prompt_ids)))
        ids, mask_full = left_pad(uniq, self.pad_id, dev, extra=max_new)
        width = ids.shape[1]
        pos = (mask_full[:, :width].cumsum(-1) - 1).clamp(min=0)
        b = len(prompt_ids)
        eos = torch.tensor(self.eos_ids, device=dev)
        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        out_tok = torch.full((b, max_new), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((b, max_new), dtype=torch.float32, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        logits, past = self._forward(ids, mask_full[:, :width], pos, None, None)
        if self.blocked_head is None:
            self._check_blocked_head(ids, mask_full[:, :width], pos, logits)
        buf = self._head_buffer(b)
        sel = torch.tensor(inv, device=dev)
        step = self._lean_applies(width + max_new) if max_new > 1 else None
        cache = StaticKV(past, step.num_layers, sel, width + max_new) if step is not None else None
        if cache is not None and self.lean:
            past = None  # decoding reads the static cache only
        elif len(uniq) < b:  # each distinct prompt was prefilled once: index its cache out to its rows
            past.batch_select_indices(sel)
        if len(uniq) < b:
            mask_full, pos, logits = mask_full[sel], pos[sel], logits[sel]
        pos = pos[:, -1:]
        mask4, mask_add = self._decode_masks(mask_full, cache, width + max_new)
        gen = self._device_generator()
        steps = 0
        for t in range(max_new):
            tok, tok_lp = sample_tokens(logits, params.temperature, params.top_p, gen, params.greedy)
            out_tok[:, t] = tok.masked_fill(finished, self.pad_id)
            out_lp[:, t] = tok_lp.masked_fill(finished, 0.0)
            lengths += ~finished
            finished |= torch.isin(tok, eos)
            steps = t + 1
            if t == max_new - 1 or bool(finished.all()):
                break
            pos = pos + 1
            step_ids, kv = out_tok[:, t:t + 1], width + t + 1
            if cache is not None:
                with self.autocast():
                    logits = self._head_logits(step(step_ids, pos, cache, kv, mask_add[..., :kv]), buf)
                if self.lean is None:
                    cache, logits, past = self._check_lean(logits, step_ids, mask_full[:, :kv], pos, past, cache)
            elif mask4 is not None and self.mask_4d is None:
                logits, past = self._check_mask_4d(step_ids, mask_full[:, :kv], mask4[..., :kv], pos, past)
            else:
                m = mask4[..., :kv] if mask4 is not None and self.mask_4d else mask_full[:, :kv]
                logits, past = self._forward(step_ids, m, pos, past, buf)
        return _generation(out_tok[:, :steps], out_lp[:, :steps], lengths, finished)

    def _head_buffer(self, rows: int) -> torch.Tensor | None:
        """The logits buffer the blocked LM head fills at every decoding step (None: the head is not
        blocked, or packed weights compute it)."""
        if not (self.blocked_head and not self._packing):
            return None
        weight = self._parts[1].weight
        return torch.empty((rows, weight.shape[0]), dtype=weight.dtype, device=self.device)

    def _decode_masks(self, mask_full: torch.Tensor, cache: StaticKV | None,
                      capacity: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The masks decoding reads beside the 2D one: (a 4D boolean mask for the model's own forward
        where it may apply, the static cache's additive mask); each None where not used."""
        if cache is not None:  # the additive mask, built once (SDPA would convert a boolean one every layer)
            zero = torch.zeros((), dtype=cache.keys[0].dtype, device=self.device)
            return None, zero.expand(mask_full.shape).masked_fill(mask_full == 0, -math.inf)[:, None, None, :]
        if self.mask_4d is not False and self._mask_4d_applies(capacity):
            return mask_full.bool()[:, None, None, :], None
        return None, None

    def _device_generator(self) -> torch.Generator:
        """The sampling generator on the engine's device: draws there (no host round trip per token),
        seeded from the host generator."""
        if self.generator.device == self.device:
            return self.generator
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        return torch.Generator(device=self.device).manual_seed(seed)

    def _check_lean(self, lean_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                    past: Any, cache: StaticKV) -> tuple[StaticKV | None, torch.Tensor, Any]:
        """Decide :attr:`lean` from one decoding step: the model's own forward of the same step (its
        cache advanced too) must give ``lean_logits`` to float rounding. Returns the static cache (or
        ``None`` where the model's forward goes on), the step's logits and the model's cache."""
        logits, past = self._forward(ids, mask, pos, past, None)
        self.lean = self._agrees("lean decoding step", lean_logits, logits)
        if self.lean:
            return cache, lean_logits, None
        return None, logits, past


def _generation(tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor,
                finished: torch.Tensor) -> Generation:
    """The sampled rows ``[B, T]`` cut to each row's length."""
    toks, lps, lens = tokens.tolist(), logprobs.tolist(), lengths.tolist()
    return Generation([t[:n] for t, n in zip(toks, lens, strict=True)],
                      [lp[:n] for lp, n in zip(lps, lens, strict=True)], finished.tolist())
