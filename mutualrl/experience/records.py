"""The typed records (:class:`Rollout`, :class:`GroupOutcome`, :class:`VerifiedSuccess`), their
content-derived ids, wire encodings (JSON, msgpack) and compact storage form."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

SCHEMA_VERSION = 1
"""Current schema version of all record kinds. A record with another version is rejected."""


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


def _canonical(obj: Any) -> str:
    """Canonical JSON: compact, sorted keys, ASCII-escaped, no NaN/inf."""
    return _CANONICAL.encode(obj)


@functools.lru_cache(maxsize=4096)
def _codec(n: int, typecode: str) -> struct.Struct:
    return struct.Struct(f"<{n}{typecode}")


def pack_array(values: Any, typecode: str) -> bytes:
    """Little-endian packed ``values`` (``typecode`` ``q``: int64, ``d``: float64)."""
    if isinstance(values, PackedArray) and values.typecode == typecode:
        return values.packed
    return _codec(len(values), typecode).pack(*values)


def unpack_array(data: bytes, typecode: str) -> tuple:
    """Inverse of :func:`pack_array`."""
    return _codec(len(data) // 8, typecode).unpack(data)


class PackedArray(Sequence):
    """A read-only sequence of int64 (``q``) or float64 (``d``) values kept packed little-endian and
    decoded on first use: records read back from storage carry these, so a query does not build
    Python numbers for traces nobody looks at. Equal to any sequence with the same values."""

    __slots__ = ("_items", "packed", "typecode")

    def __init__(self, packed: bytes, typecode: str) -> None:
        self.packed = packed
        self.typecode = typecode
        self._items: tuple | None = None

    def _values(self) -> tuple:
        if self._items is None:
            self._items = unpack_array(self.packed, self.typecode)
        return self._items

    def __len__(self) -> int:
        return len(self.packed) // 8

    def __getitem__(self, i: Any) -> Any:
        return self._values()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            return self.typecode == other.typecode and self.packed == other.packed
        if isinstance(other, (tuple, list)):
            return self._values() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return repr(self._values())


class _RecordBase:
    """Shared behaviour of all record kinds (mixin for frozen dataclasses)."""

    kind: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION
    # Derived from the dataclass fields' types by _register() (the schema is written once, as fields):
    FIELD_NAMES: ClassVar[tuple[str, ...]] = ()
    """Every field, in order."""
    ARRAY_FIELDS: ClassVar[dict[str, str]] = {}
    """Numeric list fields (``tuple[int, ...]``, ``tuple[float, ...]``) -> array typecode (``q``, ``d``)."""
    ARRAY_ITEMS: ClassVar[tuple[tuple[str, str], ...]] = ()
    SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ()
    """The fields that are not numeric lists."""
    STR_FIELDS: ClassVar[tuple[str, ...]] = ()
    ID_FIELDS: ClassVar[tuple[str, ...]] = ()
    """String fields that name something (short, non-empty); the others are free text (``TEXT``)."""
    INT_FIELDS: ClassVar[tuple[str, ...]] = ()
    FLOAT_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        # peers' and our own values in one canonical form: tuples of exact ints / floats, floats
        for name, code in self.ARRAY_ITEMS:
            values = getattr(self, name)
            object.__setattr__(self, name, tuple(values) if code == "q" else tuple(map(float, values)))
        for name in self.FLOAT_FIELDS:
            object.__setattr__(self, name, float(getattr(self, name)))

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
        """Content-derived id (see :meth:`content_id`); computed once per object."""
        return self.content_id()

    def content_id(self) -> str:
        """Content-derived id: sha256 hex digest over the canonical content, computed afresh.

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
    elif fields:  # equal-length 8-byte lists (token_ids, logprobs), decoded when first used
        size = len(arrays) // len(fields)
        for i, (name, code) in enumerate(fields):
            d[name] = PackedArray(arrays[i * size:(i + 1) * size], code)
    d["record_id"] = record_id
    return record


TEXT: Mapping[str, Any] = {"text": True}
"""Field metadata of free-text string fields (bounded by ``max_text_chars``, may be empty)."""
_ARRAY_CODES = {"tuple[int, ...]": "q", "tuple[float, ...]": "d"}


@dataclass(frozen=True)
class Rollout(_RecordBase):
    """One completion of one policy for one prompt, with its token trace.

    ``token_ids`` are in ``source_tokenizer``'s vocabulary; ``logprobs[i]`` is the behavior
    log-prob of ``token_ids[i]`` under ``source_policy`` at ``version`` (its training step).
    ``sample_index`` is the completion's index within its group, so that two identical
    completions in one group stay two records.
    """

    kind: ClassVar[str] = "rollout"
    prompt_id: str
    prompt: str = field(metadata=TEXT)
    completion: str = field(metadata=TEXT)
    source_policy: str
    source_tokenizer: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    version: int
    sample_index: int = 0
    created_at: float = field(default_factory=time.time, compare=False)


@dataclass(frozen=True)
class GroupOutcome(_RecordBase):
    """The rewards of one policy's whole group for a prompt (population mean and std)."""

    kind: ClassVar[str] = "group_outcome"
    prompt_id: str
    source_policy: str
    rewards: tuple[float, ...]
    mean: float
    std: float
    version: int
    created_at: float = field(default_factory=time.time, compare=False)

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
    completion: str = field(metadata=TEXT)
    source_policy: str
    verifier: str
    score: float
    version: int
    created_at: float = field(default_factory=time.time, compare=False)


@dataclass(frozen=True)
class PeerScore(_RecordBase):
    """A peer's log-probabilities of another policy's completion, chunk by chunk (dense signal).

    ``source_policy`` (the scorer) re-encoded another policy's completion (the rollout record
    ``rollout_id``, of step ``version``, ``sample_index`` in its group) with its own tokenizer,
    after its own prompt, and ran one forward of its own model over it. The text is cut into the
    THL chunks of the two tokenizations (:func:`mutualrl.thl.scores.score_chunks`):
    ``chunk_ends[k]`` is chunk ``k``'s end as a character offset into the completion (strictly
    increasing, the last one the text's length) and ``chunk_logprobs[k]`` the scorer's log-prob
    sum over its tokens of that chunk. ``stopped``: the completion ended on a stop token, whose
    counterpart (the scorer's EOS) has log-prob ``stop_logprob`` (0 when not stopped). The
    learner recomputes the chunking itself and refuses a score whose chunks differ.
    """

    kind: ClassVar[str] = "peer_score"
    rollout_id: str
    prompt_id: str
    version: int
    sample_index: int
    chunk_ends: tuple[int, ...]
    chunk_logprobs: tuple[float, ...]
    stopped: int
    stop_logprob: float
    source_policy: str
    source_tokenizer: str
    created_at: float = field(default_factory=time.time, compare=False)


Record = Rollout | GroupOutcome | VerifiedSuccess | PeerScore
RECORD_TYPES: dict[str, type[Rollout | GroupOutcome | VerifiedSuccess | PeerScore]] = {
    "rollout": Rollout,
    "group_outcome": GroupOutcome,
    "verified_success": VerifiedSuccess,
    "peer_score": PeerScore,
}
KINDS: tuple[str, ...] = tuple(RECORD_TYPES)


def _mean_std(xs: Any) -> tuple[float, float]:
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mean = math.fsum(xs) / n
    var = math.fsum((x - mean) ** 2 for x in xs) / n
    return mean, math.sqrt(var)


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
    """Derive every record kind's field tables from its dataclass fields (their declared types)."""
    for cls in RECORD_TYPES.values():
        fields = dataclasses.fields(cls)
        types = {f.name: str(f.type) for f in fields}
        cls.FIELD_NAMES = tuple(f.name for f in fields)
        cls.ARRAY_FIELDS = {n: _ARRAY_CODES[t] for n, t in types.items() if t in _ARRAY_CODES}
        cls.ARRAY_ITEMS = tuple(cls.ARRAY_FIELDS.items())
        cls.SCALAR_FIELDS = tuple(n for n in cls.FIELD_NAMES if n not in cls.ARRAY_FIELDS)
        cls.STR_FIELDS = tuple(n for n, t in types.items() if t == "str")
        cls.ID_FIELDS = tuple(f.name for f in fields if types[f.name] == "str" and not f.metadata.get("text"))
        cls.INT_FIELDS = tuple(n for n, t in types.items() if t == "int")
        cls.FLOAT_FIELDS = tuple(n for n, t in types.items() if t == "float")
        unknown = set(types) - set(cls.ARRAY_FIELDS) - {*cls.STR_FIELDS, *cls.INT_FIELDS, *cls.FLOAT_FIELDS}
        if unknown:
            raise TypeError(f"{cls.__name__}: fields {sorted(unknown)} have no wire type (str, int, float, "
                            "tuple[int, ...], tuple[float, ...])")


_register()

