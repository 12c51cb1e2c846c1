"""Typed experience records shared through SEE, their wire format and their validation.

Three record kinds, one per sharing level:

* :class:`Rollout` (data): a completion with its token trace, behavior log-probs and reward.
* :class:`GroupOutcome` (value): the rewards of one policy's group for a prompt, with mean/std.
* :class:`VerifiedSuccess` (outcome): a completion that a verifier accepted.

Every record is a frozen dataclass with a ``kind``, a ``SCHEMA_VERSION`` and a content-derived
``record_id`` (sha256 over the canonical JSON of its content fields, with the numeric lists
hashed as packed little-endian values; see :attr:`Rollout.record_id`). Timestamps are not
content, so republishing the same experience later yields the same id.

Wire format: one JSON object per record (:meth:`to_json`), or one msgpack map
(:meth:`to_msgpack`, when ``msgpack`` is installed). Pickle is never used. Anything coming from a
peer goes through :func:`parse`, which validates everything and raises
:class:`InvalidExperience` with a short machine-readable ``reason`` code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

SCHEMA_VERSION = 1
"""Current schema version of all record kinds. A record with another version is rejected."""

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

    The trainer builds one from its task and policies: ``reward_range`` from the task,
    ``known_prompt_ids`` from the prompt set, ``vocab_sizes`` from each policy's tokenizer.
    ``None`` for the two optional fields disables that check.
    """

    max_record_bytes: int = 4 * 1024 * 1024
    max_text_chars: int = 100_000
    max_tokens: int = 32_768
    max_group_size: int = 1024
    max_id_chars: int = 256
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


def _canonical(obj: Any) -> str:
    """Canonical JSON: compact, sorted keys, ASCII-escaped, no NaN/inf."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def pack_array(values: Any, typecode: str) -> bytes:
    """Little-endian packed ``values`` (``typecode`` ``q``: int64, ``d``: float64)."""
    return struct.pack(f"<{len(values)}{typecode}", *values)


def unpack_array(data: bytes, typecode: str) -> tuple:
    """Inverse of :func:`pack_array`."""
    return struct.unpack(f"<{len(data) // 8}{typecode}", data)


class _RecordBase:
    """Shared behaviour of all record kinds (mixin for frozen dataclasses)."""

    kind: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION
    ARRAY_FIELDS: ClassVar[dict[str, str]] = {}  # numeric list fields -> array typecode
    # Filled in by _register(): field names in order, and the non-array (scalar) ones.
    FIELD_NAMES: ClassVar[tuple[str, ...]] = ()
    SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ()
    ARRAY_ITEMS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def content(self) -> dict[str, Any]:
        """The content fields (everything but ``created_at``), with ``kind`` and ``schema_version``."""
        out: dict[str, Any] = {"kind": self.kind, "schema_version": self.SCHEMA_VERSION}
        for name in self.FIELD_NAMES:
            if name != "created_at":
                v = getattr(self, name)
                out[name] = list(v) if name in self.ARRAY_FIELDS else v
        return out

    @cached_property
    def packed_arrays(self) -> tuple[bytes, ...]:
        """The numeric list fields (``ARRAY_FIELDS``) packed little-endian, in field order."""
        return tuple(pack_array(getattr(self, n), c) for n, c in self.ARRAY_FIELDS.items())

    @cached_property
    def record_id(self) -> str:
        """Content-derived id: sha256 hex digest over the canonical content.

        The digest covers the canonical JSON of ``[kind, schema_version, <content fields other
        than the numeric lists, in field order>, <lengths of the numeric lists>]`` followed by
        the numeric lists packed little-endian (int64 token ids, float64 otherwise).
        ``created_at`` is not content, so re-publishing the same experience gives the same id.
        """
        head: list[Any] = [self.kind, self.SCHEMA_VERSION]
        head.extend(getattr(self, n) for n in self.SCALAR_FIELDS if n != "created_at")
        head.extend(len(getattr(self, n)) for n in self.ARRAY_FIELDS)
        h = hashlib.sha256(_canonical(head).encode("ascii"))
        for blob in self.packed_arrays:
            h.update(blob)
        return h.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """The wire dict: content fields, ``created_at`` and ``record_id``."""
        d = self.content()
        d["created_at"] = self.created_at  # type: ignore[attr-defined]
        d["record_id"] = self.record_id
        return d

    def to_json(self) -> str:
        """One compact JSON object (the default wire format)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    def to_msgpack(self) -> bytes:
        """One msgpack map (requires the optional ``msgpack`` package)."""
        try:
            import msgpack
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError("msgpack is not installed: pip install msgpack") from exc
        return msgpack.packb(self.to_dict(), use_bin_type=True)


StoredRow = tuple[str, str, tuple, bytes]
"""Storage form of a record: ``(kind, record_id, scalar field values, packed numeric lists)``."""


def to_row(record: Record) -> StoredRow:
    """The compact storage form of a (validated) record; inverse :func:`from_row`.

    Scalars are kept as Python values (in ``SCALAR_FIELDS`` order) and the numeric lists are
    packed little-endian, which stores and loads several times faster than numbers as JSON text.
    """
    scalars = tuple(getattr(record, n) for n in record.SCALAR_FIELDS)
    return record.kind, record.record_id, scalars, b"".join(record.packed_arrays)


def from_row(kind: str, record_id: str, scalars: Any, arrays: bytes) -> Record:
    """Rebuild a record from :func:`to_row` output without validating it (trusted storage)."""
    cls = RECORD_TYPES[kind]
    record = cls.__new__(cls)
    d = record.__dict__
    d.update(zip(cls.SCALAR_FIELDS, scalars))
    fields = cls.ARRAY_ITEMS
    if len(fields) == 1:
        name, code = fields[0]
        d[name] = unpack_array(arrays, code)
    elif fields:  # equal-length 8-byte lists (token_ids, logprobs)
        size = len(arrays) // len(fields)
        for i, (name, code) in enumerate(fields):
            d[name] = unpack_array(arrays[i * size:(i + 1) * size], code)
    d["record_id"] = record_id
    return record


def _floats(xs: Any) -> tuple[float, ...]:
    return tuple(map(float, xs))


@dataclass(frozen=True)
class Rollout(_RecordBase):
    """One completion of one policy for one prompt, with its token trace.

    ``token_ids`` are in ``source_tokenizer``'s vocabulary; ``logprobs[i]`` is the behavior
    log-prob of ``token_ids[i]`` under ``source_policy`` at ``version`` (its training step).
    ``sample_index`` is the completion's index within its group, so that two identical
    completions in one group stay two records.
    """

    kind: ClassVar[str] = "rollout"
    ARRAY_FIELDS: ClassVar[dict[str, str]] = {"token_ids": "q", "logprobs": "d"}
    prompt_id: str
    prompt: str
    completion: str
    source_policy: str
    source_tokenizer: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    version: int
    sample_index: int = 0
    created_at: float = field(default_factory=time.time, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "logprobs", _floats(self.logprobs))
        object.__setattr__(self, "reward", float(self.reward))
        object.__setattr__(self, "created_at", float(self.created_at))


@dataclass(frozen=True)
class GroupOutcome(_RecordBase):
    """The rewards of one policy's whole group for a prompt (population mean and std)."""

    kind: ClassVar[str] = "group_outcome"
    ARRAY_FIELDS: ClassVar[dict[str, str]] = {"rewards": "d"}
    prompt_id: str
    source_policy: str
    rewards: tuple[float, ...]
    mean: float
    std: float
    version: int
    created_at: float = field(default_factory=time.time, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rewards", _floats(self.rewards))
        object.__setattr__(self, "mean", float(self.mean))
        object.__setattr__(self, "std", float(self.std))
        object.__setattr__(self, "created_at", float(self.created_at))

    @classmethod
    def from_rewards(
        cls, prompt_id: str, source_policy: str, rewards: list[float], version: int, **kw: Any
    ) -> GroupOutcome:
        """Build a group outcome, computing ``mean`` and population ``std`` from ``rewards``."""
        mean, std = _mean_std(rewards)
        return cls(prompt_id, source_policy, tuple(rewards), mean, std, version, **kw)


@dataclass(frozen=True)
class VerifiedSuccess(_RecordBase):
    """A completion that ``verifier`` accepted with ``score``."""

    kind: ClassVar[str] = "verified_success"
    prompt_id: str
    completion: str
    source_policy: str
    verifier: str
    score: float
    version: int
    created_at: float = field(default_factory=time.time, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "score", float(self.score))
        object.__setattr__(self, "created_at", float(self.created_at))


Record = Rollout | GroupOutcome | VerifiedSuccess
RECORD_TYPES: dict[str, type[Rollout | GroupOutcome | VerifiedSuccess]] = {
    "rollout": Rollout,
    "group_outcome": GroupOutcome,
    "verified_success": VerifiedSuccess,
}
KINDS: tuple[str, ...] = tuple(RECORD_TYPES)


def _mean_std(xs: Any) -> tuple[float, float]:
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mean = math.fsum(xs) / n
    var = math.fsum((x - mean) ** 2 for x in xs) / n
    return mean, math.sqrt(var)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

_STR_FIELDS = {
    "rollout": ("prompt_id", "prompt", "completion", "source_policy", "source_tokenizer"),
    "group_outcome": ("prompt_id", "source_policy"),
    "verified_success": ("prompt_id", "completion", "source_policy", "verifier"),
}
_ID_FIELDS = ("prompt_id", "source_policy", "source_tokenizer", "verifier")
_TEXT_FIELDS = ("prompt", "completion")
_INT_FIELDS = {"rollout": ("version", "sample_index"), "group_outcome": ("version",),
               "verified_success": ("version",)}
_FLOAT_FIELDS = {"rollout": ("reward", "created_at"), "group_outcome": ("mean", "std", "created_at"),
                 "verified_success": ("score", "created_at")}
_LIST_FIELDS = {"rollout": {"token_ids": int, "logprobs": float}, "group_outcome": {"rewards": float},
                "verified_success": {}}


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
    kind = record.kind
    for name in _STR_FIELDS[kind]:
        s = getattr(record, name)
        if name in _ID_FIELDS:
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
    else:
        _check_reward("score", record.score, limits)


def _validate_rollout(r: Rollout, limits: ExperienceLimits) -> None:
    if not 0 <= r.sample_index <= _MAX_INT64:
        raise InvalidExperience("version_range", f"sample_index={r.sample_index} is outside [0, 2**63)")
    n = len(r.token_ids)
    if n > limits.max_tokens:
        raise InvalidExperience("too_large", f"{n} tokens (max {limits.max_tokens})")
    if len(r.logprobs) != n:
        raise InvalidExperience("length_mismatch", f"{n} token ids but {len(r.logprobs)} logprobs")
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


# ----------------------------------------------------------------------------------------------
# Parsing untrusted input
# ----------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> float:
    raise InvalidExperience("non_finite", f"JSON constant {name} is not allowed")


def _decode(obj: dict | str | bytes | bytearray | memoryview, limits: ExperienceLimits) -> Any:
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        if len(raw) > limits.max_record_bytes:
            raise InvalidExperience("too_large", f"{len(raw)} bytes (max {limits.max_record_bytes})")
        if raw.lstrip()[:1] not in (b"{", b"[", b""):
            return _decode_msgpack(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidExperience("invalid_utf8", f"not UTF-8 at byte {exc.start}") from None
    elif isinstance(obj, str):
        text = obj
        if len(text) > limits.max_record_bytes:
            raise InvalidExperience("too_large", f"{len(text)} chars (max {limits.max_record_bytes})")
    else:
        raise InvalidExperience("bad_encoding", f"expected dict, str or bytes, got {type(obj).__name__}")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except InvalidExperience:
        raise
    except (ValueError, RecursionError) as exc:
        raise InvalidExperience("bad_encoding", f"not valid JSON ({str(exc)[:80]})") from None


def _decode_msgpack(raw: bytes) -> Any:
    try:
        import msgpack
    except ImportError:  # pragma: no cover - depends on the environment
        raise InvalidExperience("bad_encoding", "not JSON, and msgpack is not installed") from None
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except UnicodeDecodeError:
        raise InvalidExperience("invalid_utf8", "a msgpack string is not UTF-8") from None
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types on garbage input
        raise InvalidExperience("bad_encoding", f"not valid msgpack ({type(exc).__name__})") from None


_INT_TYPES = frozenset({int})
_NUM_TYPES = frozenset({int, float})


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_num(x: Any) -> bool:
    return type(x) is float or type(x) is int


def parse(obj: dict | str | bytes, limits: ExperienceLimits = DEFAULT_LIMITS) -> Record:
    """Decode and validate one record from a peer.

    ``obj`` is a decoded dict, a JSON string, or bytes (UTF-8 JSON, or msgpack when the first
    byte is not ``{``). Returns the typed record; raises :class:`InvalidExperience` for anything
    wrong with it, and never another exception type.
    """
    d = _decode(obj, limits)
    if not isinstance(d, dict):
        raise InvalidExperience("bad_encoding", f"top level must be an object, got {type(d).__name__}")
    kind = d.get("kind")
    if not isinstance(kind, str) or kind not in RECORD_TYPES:
        raise InvalidExperience("unknown_kind", f"kind {str(kind)[:40]!r} is not one of {list(KINDS)}")
    sv = d.get("schema_version")
    if not _is_int(sv) or sv != SCHEMA_VERSION:
        raise InvalidExperience("schema_version", f"schema_version {str(sv)[:20]!r} != {SCHEMA_VERSION}")
    cls = RECORD_TYPES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(d) - names - {"kind", "schema_version", "record_id"}
    if extra:
        raise InvalidExperience("unknown_field", f"unknown fields {sorted(map(str, extra))[:5]}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise InvalidExperience("missing_field", f"{kind} needs field {f.name!r}")
            continue
        kwargs[f.name] = d[f.name]
    if "record_id" not in d:
        raise InvalidExperience("missing_field", f"{kind} needs field 'record_id'")
    _check_types(kind, kwargs)
    try:
        record = cls(**kwargs)
    except OverflowError:
        raise InvalidExperience("non_finite", "a number is too large for a float") from None
    validate(record, limits)
    rid = d["record_id"]
    if not isinstance(rid, str) or rid != record.record_id:
        raise InvalidExperience("bad_id", "record_id does not match the record's content")
    return record


def _check_types(kind: str, kw: dict[str, Any]) -> None:
    for name in _STR_FIELDS[kind]:
        if not isinstance(kw[name], str):
            raise InvalidExperience("wrong_type", f"{name} must be a string")
    for name in _INT_FIELDS[kind]:
        if name in kw and not _is_int(kw[name]):
            raise InvalidExperience("wrong_type", f"{name} must be an integer")
    for name in _FLOAT_FIELDS[kind]:
        if name in kw and not _is_num(kw[name]):
            raise InvalidExperience("wrong_type", f"{name} must be a number")
    for name, elem in _LIST_FIELDS[kind].items():
        v = kw[name]
        if not isinstance(v, list):
            raise InvalidExperience("wrong_type", f"{name} must be a list")
        allowed = _INT_TYPES if elem is int else _NUM_TYPES
        if not allowed.issuperset(map(type, v)):  # exact types: bool is not an int here
            raise InvalidExperience("wrong_type", f"{name} must hold only {elem.__name__}s")


def from_dict(d: Mapping[str, Any]) -> Record:
    """Rebuild a record from a trusted :meth:`to_dict` (no validation; use :func:`parse` for peers)."""
    d = dict(d)
    kind = d.pop("kind")
    d.pop("schema_version", None)
    rid = d.pop("record_id", None)
    record = RECORD_TYPES[kind](**d)
    if rid is not None:
        record.__dict__["record_id"] = rid
    return record


def _register() -> None:
    for cls in RECORD_TYPES.values():
        names = tuple(f.name for f in dataclasses.fields(cls))
        cls.FIELD_NAMES = names
        cls.SCALAR_FIELDS = tuple(n for n in names if n not in cls.ARRAY_FIELDS)
        cls.ARRAY_ITEMS = tuple(cls.ARRAY_FIELDS.items())


_register()
