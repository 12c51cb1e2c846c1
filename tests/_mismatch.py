"""The sampler/trainer mismatch of sampled completions (the vLLM tests' one measure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mutualrl.rollout.token_tensors import pack_right, right_mask


def sampler_mismatch(pol: Any, samples: Sequence[Any]) -> float:
    """The largest |trainer log-prob - sampler's behavior log-prob| over the sampled tokens."""
    w = max(len(s.completion_ids) for s in samples)
    with torch.no_grad():
        lp = pol.logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    old = pack_right([s.logprobs for s in samples], w)
    mask = right_mask([len(s.completion_ids) for s in samples], w)
    return float(((lp - old).abs() * mask).max())
