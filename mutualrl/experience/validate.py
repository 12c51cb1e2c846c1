"""Validation of typed records against :class:`~mutualrl.experience.limits.ExperienceLimits`."""

from __future__ import annotations

import math

from mutualrl.experience.limits import (
    _LOGPROB_TOLERANCE,
    _MAX_INT64,
    _MAX_TOKEN_ID,
    DEFAULT_LIMITS,
    ExperienceLimits,
    InvalidExperience,
)
from mutualrl.experience.records import GroupOutcome, PeerScore, Record, Rollout, _mean_std


def _check_text(name: str, s: str, cap: int) -> None:
    if len(s) > cap:
        raise InvalidExperience("too_large", f"{name} has {len(s)} chars (max {cap})")
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidExperience("invalid_utf8", f"{name} is not valid UTF-8 ({exc.reason})") from None


def _check_finite(name: str, x: float) -> None:
    if not math.isfinite(x):
        raise InvalidExperience("non_finite", f"{name} is {x}")


def _check_reward(name: str, x: float, limits: ExperienceLimits) -> None:
    _check_finite(name, x)
    lo, hi = limits.reward_range
    if not lo <= x <= hi:
        raise InvalidExperience("reward_range", f"{name}={x} is outside the task's range [{lo}, {hi}]")


def validate(record: Record, limits: ExperienceLimits = DEFAULT_LIMITS) -> None:
    """Check a typed record's values against ``limits``; raise :class:`InvalidExperience`.

    Types are assumed right (the dataclass constructors normalise them); :func:`parse` checks
    types of untrusted input before it builds the record.
    """
    try:
        _validate(record, limits)
    except OverflowError:
        raise InvalidExperience("non_finite", "a number overflows a float") from None


def _validate(record: Record, limits: ExperienceLimits) -> None:
    for name in record.STR_FIELDS:
        s = getattr(record, name)
        if name in record.ID_FIELDS:
            if not s:
                raise InvalidExperience("empty", f"{name} is empty")
            _check_text(name, s, limits.max_id_chars)
        else:
            _check_text(name, s, limits.max_text_chars)
    if not 0 <= record.version <= _MAX_INT64:
        raise InvalidExperience("version_range", f"version={record.version} is outside [0, 2**63)")
    _check_finite("created_at", record.created_at)
    if record.created_at < 0:
        raise InvalidExperience("version_range", f"created_at={record.created_at} is negative")
    if limits.known_prompt_ids is not None and record.prompt_id not in limits.known_prompt_ids:
        raise InvalidExperience("unknown_prompt", f"prompt_id {record.prompt_id!r} is not a known prompt")
    if isinstance(record, Rollout):
        _validate_rollout(record, limits)
    elif isinstance(record, GroupOutcome):
        _validate_group(record, limits)
    elif isinstance(record, PeerScore):
        _validate_score(record, limits)
    else:
        _check_reward("score", record.score, limits)


def _check_trace(index: int, n: int, m: int, names: tuple[str, str, str], limits: ExperienceLimits) -> int:
    """A trace's sample index in range, its length ``n`` within the token cap and equal to its values'
    ``m`` (``names``: what the units, the positions and the values are called); returns ``n``."""
    if not 0 <= index <= _MAX_INT64:
        raise InvalidExperience("version_range", f"sample_index={index} is outside [0, 2**63)")
    if n > limits.max_tokens:
        raise InvalidExperience("too_large", f"{n} {names[0]} (max {limits.max_tokens})")
    if m != n:
        raise InvalidExperience("length_mismatch", f"{n} {names[1]} but {m} {names[2]}")
    return n


def _validate_rollout(r: Rollout, limits: ExperienceLimits) -> None:
    n = _check_trace(r.sample_index, len(r.token_ids), len(r.logprobs), ("tokens", "token ids", "logprobs"), limits)
    _check_reward("reward", r.reward, limits)
    if n:
        if not math.isfinite(sum(r.logprobs)):  # one fast pass; NaN/inf propagate
            raise InvalidExperience("non_finite", "a logprob is NaN, infinite or overflows")
        if max(r.logprobs) > _LOGPROB_TOLERANCE:
            raise InvalidExperience("logprob_range", f"a logprob is positive ({max(r.logprobs)})")
        vocab = _MAX_TOKEN_ID + 1
        if limits.vocab_sizes is not None and r.source_tokenizer in limits.vocab_sizes:
            vocab = limits.vocab_sizes[r.source_tokenizer]
        if min(r.token_ids) < 0 or max(r.token_ids) >= vocab:
            raise InvalidExperience(
                "token_range", f"token ids must lie in [0, {vocab}) for tokenizer {r.source_tokenizer!r}"
            )


def _validate_group(g: GroupOutcome, limits: ExperienceLimits) -> None:
    n = len(g.rewards)
    if n == 0:
        raise InvalidExperience("empty", "the group has no rewards")
    if n > limits.max_group_size:
        raise InvalidExperience("too_large", f"group of {n} (max {limits.max_group_size})")
    for x in g.rewards:
        _check_reward("rewards[]", x, limits)
    _check_finite("mean", g.mean)
    _check_finite("std", g.std)
    mean, std = _mean_std(g.rewards)
    scale = 1e-6 * (1.0 + max(abs(x) for x in g.rewards))
    if abs(mean - g.mean) > scale or abs(std - g.std) > scale:
        raise InvalidExperience(
            "inconsistent", f"mean/std ({g.mean}, {g.std}) do not match the rewards ({mean}, {std})"
        )




def _validate_score(s: PeerScore, limits: ExperienceLimits) -> None:
    n = _check_trace(s.sample_index, len(s.chunk_ends), len(s.chunk_logprobs),
                     ("chunks", "chunk ends", "chunk log-probs"), limits)
    if s.stopped not in (0, 1):
        raise InvalidExperience("wrong_type", f"stopped={s.stopped} is not 0 or 1")
    values = [*s.chunk_logprobs, s.stop_logprob]
    if not math.isfinite(math.fsum(values)) or not all(math.isfinite(v) for v in values):
        raise InvalidExperience("non_finite", "a chunk log-prob is NaN, infinite or overflows")
    if max(values) > _LOGPROB_TOLERANCE:
        raise InvalidExperience("logprob_range", f"a chunk log-prob is positive ({max(values)})")
    if n and (s.chunk_ends[0] <= 0 or s.chunk_ends[-1] > limits.max_text_chars
              or any(b <= a for a, b in zip(s.chunk_ends, s.chunk_ends[1:]))):
        raise InvalidExperience("inconsistent", "chunk ends must be positive character offsets, strictly "
                                f"increasing, at most {limits.max_text_chars}")
