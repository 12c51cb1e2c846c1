"""What incoming experience is checked against: the refusal reasons, the error, the limits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REASONS: tuple[str, ...] = (
    "bad_encoding",  # not decodable JSON/msgpack, or the top level is not an object
    "invalid_utf8",  # bytes or strings that are not valid UTF-8 (incl. lone surrogates)
    "unknown_kind",
    "schema_version",
    "missing_field",
    "unknown_field",
    "wrong_type",
    "non_finite",  # NaN or +-inf anywhere
    "reward_range",  # reward / score outside ExperienceLimits.reward_range
    "logprob_range",  # a behavior log-prob > 0 (beyond a small tolerance)
    "token_range",  # a token id < 0 or >= the tokenizer's vocab size
    "version_range",  # a policy version / sample index / timestamp outside its range
    "length_mismatch",  # token_ids and logprobs of different lengths
    "too_large",  # over a size cap (record bytes, text chars, tokens, group size)
    "empty",  # an empty identifier or group
    "bad_id",  # record_id is not a string or does not match the content
    "unknown_prompt",  # prompt_id not in ExperienceLimits.known_prompt_ids
    "inconsistent",  # a group's mean/std do not match its rewards
    "too_deep",  # nested deeper than any record field can be
)
"""Every ``InvalidExperience.reason`` code :func:`parse` can raise."""

_LOGPROB_TOLERANCE = 1e-3
_MAX_TOKEN_ID = 2**31 - 1
_MAX_INT64 = 2**63 - 1


class InvalidExperience(ValueError):
    """A record failed validation. ``reason`` is one of :data:`REASONS`; the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


@dataclass(frozen=True)
class ExperienceLimits:
    """Caps and task facts that every incoming record is checked against.

    Each policy worker builds one from its task and the run's policies: ``reward_range`` from the
    task, ``known_prompt_ids`` from the prompt set, ``vocab_sizes`` from each policy's tokenizer.
    ``None`` for the two optional fields disables that check.
    """

    max_record_bytes: int = 4 * 1024 * 1024
    max_text_chars: int = 100_000
    max_tokens: int = 32_768
    max_group_size: int = 1024
    max_id_chars: int = 256
    version_window: int = 1024
    """Once the exchange's clock is set (:meth:`~mutualrl.exchange.base.Exchange.advance`), rows whose
    version is more than this many steps away from it are refused (``version_range``)."""
    reward_range: tuple[float, float] = (-math.inf, math.inf)
    vocab_sizes: Mapping[str, int] | None = None
    known_prompt_ids: frozenset[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (for sending limits to another process)."""
        return {
            "max_record_bytes": self.max_record_bytes,
            "max_text_chars": self.max_text_chars,
            "max_tokens": self.max_tokens,
            "max_group_size": self.max_group_size,
            "max_id_chars": self.max_id_chars,
            "version_window": self.version_window,
            "reward_range": [_inf_to_str(self.reward_range[0]), _inf_to_str(self.reward_range[1])],
            "vocab_sizes": dict(self.vocab_sizes) if self.vocab_sizes is not None else None,
            "known_prompt_ids": sorted(self.known_prompt_ids) if self.known_prompt_ids is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExperienceLimits:
        """Inverse of :meth:`to_dict`."""
        kw = dict(d)
        lo, hi = kw.get("reward_range", ("-inf", "inf"))
        kw["reward_range"] = (float(lo), float(hi))
        if kw.get("known_prompt_ids") is not None:
            kw["known_prompt_ids"] = frozenset(kw["known_prompt_ids"])
        return cls(**kw)


def _inf_to_str(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


DEFAULT_LIMITS = ExperienceLimits()


