"""Generation engines: prompt ids in, sampled completion ids and behavior log-probs out.

The seam between a policy and its sampler.

:class:`GenerationEngine` is the seam a sampler plugs into (:class:`~mutualrl.engines.hf.HFEngine` is the default,
:class:`~mutualrl.engines.vllm.VLLMEngine` another). An engine samples ``n`` completions per prompt with the
:class:`SamplingParams` and returns, per completion, its token ids (EOS last when it stopped on
one), the behavior log-prob of each token under the distribution it was sampled from (after
temperature and top-p) and whether it finished.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``max_new_tokens``, ``temperature``, ``top_p``; ``greedy`` takes the argmax
    (its log-probs are those of the untempered distribution)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


@dataclass
class Generation:
    """Completions in prompt-major order: ``n`` rows per prompt."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]


class GenerationEngine(Protocol):
    """What the policy needs from a sampler."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams) -> Generation:
        """``n`` completions of each prompt (prompt-major)."""
        ...

    def sync_weights(self) -> float:
        """Make the engine sample from the trainer's current weights; return the seconds it took."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...


def dedupe_prompts(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in first-seen order and, per row, the index of its prompt among them."""
    index: dict[tuple[int, ...], int] = {}
    inv = []
    for p in prompt_ids:
        inv.append(index.setdefault(tuple(p), len(index)))
    return [list(k) for k in index], inv


def cache_kwarg(model: torch.nn.Module) -> str:
    """The KV-cache argument name of this transformers version (``cache`` or ``past_key_values``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # through a peft wrapper
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device, min_width: int = 0,
             extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids ``[B, W]`` and attention mask ``[B, W + extra]`` (the ``extra`` columns,
    ones, are room for tokens generated later), built on the host and moved once."""
    width = max(min_width, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width + extra), dtype=torch.long)
    mask[:, width:] = 1
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.as_tensor(list(s))
            mask[i, width - len(s):width] = 1
    return ids.to(device), mask.to(device)


def top_p_filter(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalised log-probs restricted to the nucleus of mass ``top_p``."""
    sorted_lp, idx = logp.sort(dim=-1, descending=True)
    cum = sorted_lp.exp().cumsum(-1)
    drop_sorted = (cum - sorted_lp.exp()) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    filtered = logp.masked_fill(drop, -math.inf)
    return filtered - torch.logsumexp(filtered, dim=-1, keepdim=True)
