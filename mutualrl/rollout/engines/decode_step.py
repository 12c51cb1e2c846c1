"""A lean decoding step for GPT-2 and Llama-family models over a preallocated KV cache.

A decoding step of a Hugging Face causal LM spends, on a small model, most of its time outside
the arithmetic: the generic forward builds output records, dispatches attention through an
interface table, grows the cache by concatenation and handles options a sampling loop never uses.
The zoo's 3-layer GPT-2 took ~3.4 ms a token that way on 16 rows, its matrix products ~0.2 ms.

A :class:`DecodeStep` does one step of one position for every row with the model's own modules
(embeddings, norms, projections, MLPs, the rotary embedding; a LoRA-wrapped or prepacked layer
computes as it would in the model's forward) and only the attention written out: each layer's new
key and value are written into a :class:`StaticKV` buffer sized for the whole completion, and
scaled dot-product attention reads its first ``kv`` positions under the padding mask. The values
are the model's own to float rounding; the engine checks that on its first call
(:class:`~mutualrl.rollout.engines.hf.HFEngine`) and keeps the model's forward otherwise.

:data:`DECODE_STEPS` maps a ``model_type`` to its step; each entry says through ``unsupported``
which configurations it does not cover (the engine then keeps the model's forward).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from mutualrl.rollout.engines.base import unwrap_peft


def _sdpa_takes_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (2.5 and later)."""
    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: try it
        try:
            x = torch.zeros(1, 2, 1, 1)
            F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
        except TypeError:
            return False
        return True


_SDPA_GQA = _sdpa_takes_gqa()


def _layer_kv(past: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s keys and values ``[B, H_kv, S, D]`` of a transformers cache (any version's
    layout: cache layers, key/value lists or legacy tuples)."""
    if hasattr(past, "layers"):
        layer = past.layers[i]
        return layer.keys, layer.values
    if hasattr(past, "key_cache"):
        return past.key_cache[i], past.value_cache[i]
    k, v = past[i][:2]
    return k, v


class StaticKV:
    """Per-layer key and value buffers ``[B, H_kv, capacity, D]``, filled from a prefill's cache.

    Args:
        past: the cache a prefill returned (one row per distinct prompt).
        layers: how many layers it holds.
        rows: for each output row, the prefill row it continues (a GRPO group shares one prompt).
        capacity: positions to hold: the prompt width plus the tokens to generate.
    """

    def __init__(self, past: Any, layers: int, rows: torch.Tensor, capacity: int) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for i in range(layers):
            k, v = _layer_kv(past, i)
            width = k.shape[2]
            if width > capacity:
                raise ValueError(f"a prefill of {width} positions does not fit a cache of {capacity}")
            kb = k.new_empty((rows.shape[0], k.shape[1], capacity, k.shape[3]))
            vb = v.new_empty((rows.shape[0], v.shape[1], capacity, v.shape[3]))
            torch.index_select(k, 0, rows, out=kb[:, :, :width])
            torch.index_select(v, 0, rows, out=vb[:, :, :width])
            self.keys.append(kb)
            self.values.append(vb)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: int,
               mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Write layer ``i``'s new key and value ``[B, H_kv, 1, D]`` at position ``kv - 1`` and return
        the attention of ``q`` ``[B, H, 1, D]`` over positions ``< kv``, ``[B, 1, H * D]``. ``mask``
        is ``[B, 1, 1, kv]``: True where a row attends, or the additive form (0 there, -inf
        elsewhere, in the cache's dtype: what SDPA turns a boolean mask into at every call)."""
        kb, vb = self.keys[i], self.values[i]
        kb[:, :, kv - 1:kv] = k
        vb[:, :, kv - 1:kv] = v
        keys, values = kb[:, :, :kv], vb[:, :, :kv]
        groups = q.shape[1] // keys.shape[1]
        if groups > 1 and _SDPA_GQA:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return o.transpose(1, 2).reshape(q.shape[0], 1, -1)


class DecodeStep:
    """One decoding step of one position: token ids ``[B, 1]`` and positions ``[B, 1]`` in, the final
    normalised hidden state ``[B, hidden]`` out (the LM head is the engine's)."""

    model_types: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def unsupported(cls, config: Any) -> str | None:
        """Why this step does not reproduce the model of ``config`` (``None``: it does)."""
        return None

    num_layers: int
    window: int | None = None
    """The attention window, where the model has one: the step covers sequences up to it only."""

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: StaticKV, kv: int,
                 mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GPT2DecodeStep(DecodeStep):
    """GPT-2: learned positions, pre-norm blocks, fused QKV ``Conv1D``. Its ``gelu_new`` MLP
    activation (eight elementwise ops in transformers) is computed by torch's fused tanh-GELU, the
    same formula to float rounding."""

    model_types = ("gpt2",)

    @classmethod
    def unsupported(cls, config: Any) -> str | None:
        if getattr(config, "reorder_and_upcast_attn", False):
            return "reorder_and_upcast_attn"
        if getattr(config, "add_cross_attention", False):
            return "cross-attention"
        return None

    def __init__(self, model: torch.nn.Module) -> None:
        self.t = unwrap_peft(model).transformer
        self.blocks = list(self.t.h)
        self.num_layers = len(self.blocks)
        self.gelu_tanh = [type(getattr(b.mlp, "act", None)).__name__ == "NewGELUActivation" for b in self.blocks]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: StaticKV, kv: int,
                 mask: torch.Tensor) -> torch.Tensor:
        t = self.t
        h = t.wte(ids) + t.wpe(pos)
        b = ids.shape[0]
        for i, block in enumerate(self.blocks):
            attn = block.attn
            heads, dim = attn.num_heads, attn.head_dim
            q, k, v = attn.c_attn(block.ln_1(h)).view(b, 1, 3, heads, dim).unbind(2)
            o = cache.attend(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kv, mask, attn.scaling)
            h = h + attn.c_proj(o)
            mlp = block.mlp
            if self.gelu_tanh[i]:
                h = h + mlp.c_proj(F.gelu(mlp.c_fc(block.ln_2(h)), approximate="tanh"))
            else:
                h = h + mlp(block.ln_2(h))
        return t.ln_f(h)[:, -1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaDecodeStep(DecodeStep):
    """Llama and the models shaped like it (Mistral, Qwen2, Qwen3's per-head q/k norms): rotary
    positions, RMS-normed pre-norm blocks, grouped-query attention, a gated MLP."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")

    @classmethod
    def unsupported(cls, config: Any) -> str | None:
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp"
        return None

    def __init__(self, model: torch.nn.Module) -> None:
        self.m = unwrap_peft(model).get_decoder()
        self.layers = list(self.m.layers)
        self.num_layers = len(self.layers)
        config = self.m.config
        windows = [getattr(config, k, None) for k in ("sliding_window", "attention_chunk_size")]
        if not getattr(config, "use_sliding_window", True):  # Qwen2 keeps a window it does not use
            windows[0] = None
        windows = [w for w in windows if w is not None]
        self.window = min(windows) if windows else None

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: StaticKV, kv: int,
                 mask: torch.Tensor) -> torch.Tensor:
        m = self.m
        h = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b = ids.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            dim = attn.head_dim
            r = layer.input_layernorm(h)
            q = attn.q_proj(r).view(b, 1, -1, dim)
            k = attn.k_proj(r).view(b, 1, -1, dim)
            v = attn.v_proj(r).view(b, 1, -1, dim)
            if getattr(attn, "q_norm", None) is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            h = h + attn.o_proj(cache.attend(i, q, k, v, kv, mask, attn.scaling))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.norm(h)[:, -1]


DECODE_STEPS: dict[str, type[DecodeStep]] = {
    t: step for step in (GPT2DecodeStep, LlamaDecodeStep) for t in step.model_types}
"""``model_type`` -> the :class:`DecodeStep` that reproduces it."""


def decode_step_for(model: torch.nn.Module) -> DecodeStep | None:
    """The lean step for ``model`` (through a peft wrapper), or ``None`` where no registered step
    covers its architecture and configuration."""
    config = getattr(unwrap_peft(model), "config", None)
    step = DECODE_STEPS.get(getattr(config, "model_type", None))
    if step is None or step.unsupported(config) is not None:
        return None
    try:
        return step(model)
    except (AttributeError, TypeError):
        return None
