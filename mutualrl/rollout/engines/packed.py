"""Decoding through linear layers whose weights are prepacked for the CPU's GEMM library (fp32).

A decoding step multiplies a few rows (a GRPO batch: 8-64) by every weight matrix of the model.
At that shape a plain BLAS call spends much of its time re-laying out the weight matrix into the
blocks its kernel reads. Both of torch's CPU GEMM libraries can take the weight already laid out
-- what inductor's CPU weight freezing uses -- and then run the same product faster:

- ``mkl``: MKL's packed GEMM (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``),
  bit-for-bit the plain layer's output (checked at 1-200 rows on every SmolLM2 and zoo shape).
  On this project's Intel Xeon (2 threads, 16 rows): SmolLM2's 576 x 1536 91 -> 178 GFLOP/s,
  1536 x 576 117 -> 177, 576 x 576 118 -> 202, the 49k-row head 90 -> 134, the zoo's 480 x 160
  79 -> 145.
- ``onednn``: oneDNN's prepacked linear (``torch.ops.mkldnn._reorder_linear_weight`` /
  ``_linear_pointwise``), equal to float rounding. On the project's AMD EPYC machine, where MKL
  takes a slower path: 576 x 1536 95 -> 188 GFLOP/s, the head 40 -> 138; on the Intel Xeon it
  loses on layers of fewer than ~300k weights (the zoo's 0.6-0.7x).

:func:`default_backend` takes ``mkl`` on Intel CPUs and ``onednn`` elsewhere. The weights change
after every optimizer step, so :func:`packed_linears` packs them again at the start of each
sampling call (a copy of every weight matrix, the cost of reading the model once: ~35 ms for
SmolLM2's head) and drops the copies at its end; training never sees them. The engine checks on
its first call that the packed layers give the model's own logits and keeps the plain layers
otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

BACKENDS = ("mkl", "onednn")


def packing_available(backend: str = "onednn") -> bool:
    """Whether this torch build has ``backend``'s prepacked linear (``mkl``: builds with MKL;
    ``onednn``: builds with mkldnn; the x86 CPU wheels have both)."""
    try:
        if backend == "mkl":
            ops = getattr(torch.ops, "mkl", None)
            return (torch.backends.mkl.is_available() and ops is not None
                    and hasattr(ops, "_mkl_reorder_linear_weight") and hasattr(ops, "_mkl_linear"))
        ops = getattr(torch.ops, "mkldnn", None)
        return (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...; ``""`` where unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_backend() -> str | None:
    """``mkl`` on Intel CPUs, ``onednn`` elsewhere (where that backend is in this torch build;
    the other one if only it is; ``None`` if neither)."""
    order = ("mkl", "onednn") if cpu_vendor() == "GenuineIntel" else ("onednn", "mkl")
    return next((b for b in order if packing_available(b)), None)


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


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's weight as ``[out, in]`` (GPT-2's ``Conv1D`` stores it ``[in, out]``: y = x @ W + b)."""
    w = layer.weight.detach()
    return w if type(layer) is torch.nn.Linear else w.t().contiguous()


class _OneDNNPacked:
    """A linear layer's forward over its weight prepacked for oneDNN."""

    __slots__ = ("bias", "weight")

    def __init__(self, layer: torch.nn.Module, rows: int) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(_weight(layer), rows)
        self.bias = None if layer.bias is None else layer.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class _MKLPacked:
    """A linear layer's forward over its weight packed for MKL's packed GEMM."""

    __slots__ = ("bias", "plain", "rows", "weight")

    def __init__(self, layer: torch.nn.Module, rows: int) -> None:
        self.plain = _weight(layer)
        self.rows = rows
        self.weight = torch.ops.mkl._mkl_reorder_linear_weight(self.plain, rows)
        self.bias = None if layer.bias is None else layer.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.weight, self.plain, self.bias, self.rows)


_PACKERS = {"mkl": _MKLPacked, "onednn": _OneDNNPacked}


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int, backend: str = "onednn") -> Iterator[int]:
    """Within the block, every :func:`packable_linears` layer of ``model`` computes through a weight
    prepacked by ``backend`` (:data:`BACKENDS`) for ``rows`` input rows (a hint: any number of rows
    works); yields how many layers.

    For inference only (no gradients flow to the packed copies). The layers' own ``forward`` is
    restored on exit, whatever happens inside.
    """
    packer = _PACKERS[backend]
    layers = packable_linears(model)
    done: list[torch.nn.Module] = []
    try:
        with torch.no_grad():
            for layer in layers:
                layer.forward = packer(layer, max(1, rows))  # an instance attribute shadows the method
                done.append(layer)
        yield len(done)
    finally:
        for layer in done:
            del layer.forward
