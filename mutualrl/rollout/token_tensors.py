"""Right-aligned token tensors and the chunked log-probs of an LM head.

Token-level tensors for training use a *right-aligned* layout ``[B, C]``: the completion of row
``i`` occupies its last ``len_i`` columns. :func:`head_logprobs` runs the LM head over hidden
states in chunks bounded by a number of logits, so a large vocabulary (Gemma-3's 262k) never
materialises a ``B x T x V`` logits tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOGITS_BUDGET = 1 << 25
"""Most logits (elements) the training forward holds at once: 32 M floats, 128 MiB in fp32."""


def pack_right(rows: Sequence[Sequence[float]], width: int, fill: float = 0.0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pack ragged rows into a right-aligned ``[len(rows), width]`` tensor."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, width - len(r):] = torch.as_tensor(list(r), dtype=dtype)
    return out


def right_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """Boolean ``[B, width]`` mask of the right-aligned positions holding tokens."""
    lens = torch.as_tensor(list(lengths)).unsqueeze(1)
    return torch.arange(width).unsqueeze(0) >= (width - lens)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  budget: int = LOGITS_BUDGET, softcap: float | None = None) -> torch.Tensor:
    """``log softmax(head(hidden) / T)`` at ``targets`` (``[B, n, H]``, ``[B, n]`` -> ``[B, n]``, fp32).

    Rows are processed in chunks of at most ``budget`` logits; with more than one chunk and
    gradients on, each chunk's logits are recomputed in the backward pass instead of kept.
    """
    b, n, h = hidden.shape
    flat, tflat = hidden.reshape(b * n, h), targets.reshape(b * n)
    vocab = head.weight.shape[0]
    rows = max(1, budget // max(1, vocab))

    def piece(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = head(x).float()
        if softcap:  # Gemma-2-style final logit soft-capping, as the model's own forward does
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
        # log-softmax at the target through cross-entropy: one fused kernel each way (a gather minus
        # logsumexp backpropagates through three passes over the logits: ~2x slower on SmolLM2's)
        return -F.cross_entropy(logits, t, reduction="none")

    if flat.shape[0] <= rows:
        return piece(flat, tflat).reshape(b, n)
    recompute = torch.is_grad_enabled() and flat.requires_grad
    parts = []
    for s in range(0, flat.shape[0], rows):
        x, t = flat[s:s + rows], tflat[s:s + rows]
        parts.append(checkpoint(piece, x, t, use_reentrant=False) if recompute else piece(x, t))
    return torch.cat(parts).reshape(b, n)
