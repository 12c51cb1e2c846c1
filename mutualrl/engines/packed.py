"""Decoding through linear layers whose weights are prepacked for oneDNN (CPU, fp32).

A decoding step multiplies a few rows (a GRPO batch: 8-64) by every weight matrix of the model.
At that shape a plain BLAS call spends much of its time re-laying out the weight matrix into the
blocks its kernel reads; oneDNN can take the weight already laid out (``torch.ops.mkldnn.
_reorder_linear_weight``, what inductor's CPU freezing uses) and then runs the same product
about twice as fast. Measured on this project's 2-core AVX-512 machine, fp32, 2 threads, 16 rows:
576 x 1536 95 -> 188 GFLOP/s, 1536 x 576 91 -> 154, SmolLM2's 49k-row LM head 40 -> 138.

The weights change after every optimizer step, so :func:`packed_linears` packs them again at the
start of each sampling call (a copy of every weight matrix, the cost of reading the model once)
and drops the copies at its end; training never sees them. Each output is the same dot product
summed in another order, equal to the plain layer's to float rounding; the engine checks that on
its first call and keeps the plain layers otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def packing_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (CPU builds with mkldnn do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def packable_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's plain fp32 CPU ``nn.Linear`` layers and GPT-2-style ``Conv1D`` layers (a linear
    layer with its weight stored transposed); a LoRA layer's base layer counts, the LoRA layer
    itself and quantized layers keep their own forward."""
    conv1d = _conv1d_type()
    return [m for m in model.modules()
            if (type(m) is torch.nn.Linear or (conv1d is not None and type(m) is conv1d))
            and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


class _Packed:
    """A linear layer's forward over its prepacked weight."""

    __slots__ = ("bias", "weight")

    def __init__(self, layer: torch.nn.Module, rows: int) -> None:
        w = layer.weight.detach()
        if type(layer) is not torch.nn.Linear:  # Conv1D: y = x @ W + b, W stored [in, out]
            w = w.t().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        self.bias = None if layer.bias is None else layer.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int) -> Iterator[int]:
    """Within the block, every :func:`packable_linears` layer of ``model`` computes through a weight
    prepacked for ``rows`` input rows (a hint: any number of rows works); yields how many layers.

    For inference only (no gradients flow to the packed copies). The layers' own ``forward`` is
    restored on exit, whatever happens inside.
    """
    layers = packable_linears(model)
    done: list[torch.nn.Module] = []
    try:
        with torch.no_grad():
            for layer in layers:
                layer.forward = _Packed(layer, max(1, rows))  # an instance attribute shadows the method
                done.append(layer)
        yield len(done)
    finally:
        for layer in done:
            del layer.forward
