"""Parsing untrusted input: bytes or decoded objects from a peer into validated records, or a refusal."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mutualrl.experience.limits import DEFAULT_LIMITS, ExperienceLimits, InvalidExperience
from mutualrl.experience.records import KINDS, RECORD_TYPES, SCHEMA_VERSION, Record, unpack_array
from mutualrl.experience.validate import validate


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
    except RecursionError:
        raise InvalidExperience("too_deep", "JSON nested too deeply") from None
    except ValueError as exc:
        raise InvalidExperience("bad_encoding", f"not valid JSON ({str(exc)[:80]})") from None


def _decode_msgpack(raw: bytes) -> Any:
    try:
        import msgpack
    except ImportError:  # pragma: no cover - depends on the environment
        raise InvalidExperience("bad_encoding", "not JSON, and msgpack is not installed") from None
    try:
        # bounded like JSON text: no container or string larger than the record cap allows
        n = len(raw)
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=n, max_bin_len=n, max_array_len=n,
                               max_map_len=n, max_ext_len=n)
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


def _short(x: Any, n: int = 40) -> str:
    """A bounded description of an untrusted value (never ``str()`` of a whole structure)."""
    if isinstance(x, str):
        return repr(x[:n])
    if type(x) in (int, float, bool) or x is None:
        return repr(x)[:n]
    return f"<{type(x).__name__}>"


def _check_shape(d: dict, limits: ExperienceLimits) -> None:
    """Bound nesting and element counts of a decoded record before anything walks it.

    A record is an object whose values are scalars or flat lists of numbers: anything nested
    deeper, or with more elements than the token cap allows, is refused. Iterative, so a peer's
    thousand-level nesting cannot exhaust the stack."""
    if len(d) > 64:
        raise InvalidExperience("too_large", f"{len(d)} fields")
    for key, v in d.items():
        if isinstance(v, (list, tuple)):
            if len(v) > max(limits.max_tokens, limits.max_group_size):
                raise InvalidExperience("too_large", f"{_short(key)} has {len(v)} elements")
            for x in v:
                if isinstance(x, (list, tuple, dict)):
                    raise InvalidExperience("too_deep", f"{_short(key)} holds a nested {type(x).__name__}")
        elif isinstance(v, dict):
            raise InvalidExperience("too_deep", f"{_short(key)} is an object; record fields are scalars or lists")


def parse(obj: dict | str | bytes, limits: ExperienceLimits = DEFAULT_LIMITS) -> Record:
    """Decode and validate one record from a peer.

    ``obj`` is a decoded dict, a JSON string, or bytes (UTF-8 JSON, or msgpack when the first
    byte is not ``{``). Returns the typed record; raises :class:`InvalidExperience` for anything
    wrong with it, and never another exception type: sizes are bounded before decoding, nesting
    before any walk, and messages never render an untrusted structure.
    """
    try:
        return _parse(obj, limits)
    except InvalidExperience:
        raise
    except RecursionError:
        raise InvalidExperience("too_deep", "nested too deeply to decode") from None
    except (TypeError, ValueError, OverflowError, KeyError, AttributeError, UnicodeError) as exc:
        raise InvalidExperience("bad_encoding", f"{type(exc).__name__} while reading the record") from None


def _parse(obj: dict | str | bytes, limits: ExperienceLimits) -> Record:
    d = _decode(obj, limits)
    if not isinstance(d, dict):
        raise InvalidExperience("bad_encoding", f"top level must be an object, got {type(d).__name__}")
    _check_shape(d, limits)
    kind = d.get("kind")
    if not isinstance(kind, str) or kind not in RECORD_TYPES:
        raise InvalidExperience("unknown_kind", f"kind {_short(kind)} is not one of {list(KINDS)}")
    sv = d.get("schema_version")
    if not _is_int(sv) or sv != SCHEMA_VERSION:
        raise InvalidExperience("schema_version", f"schema_version {_short(sv, 20)} != {SCHEMA_VERSION}")
    cls = RECORD_TYPES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(d) - names - {"kind", "schema_version", "record_id"}
    if extra:
        raise InvalidExperience("unknown_field", f"unknown fields {[_short(k, 30) for k in list(extra)[:5]]}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise InvalidExperience("missing_field", f"{kind} needs field {f.name!r}")
            continue
        kwargs[f.name] = d[f.name]
    if "record_id" not in d:
        raise InvalidExperience("missing_field", f"{kind} needs field 'record_id'")
    _check_types(cls, kwargs)
    try:
        record = cls(**kwargs)
    except OverflowError:
        raise InvalidExperience("non_finite", "a number is too large for a float") from None
    validate(record, limits)
    rid = d["record_id"]
    if not isinstance(rid, str) or rid != record.record_id:
        raise InvalidExperience("bad_id", "record_id does not match the record's content")
    return record


def _check_types(cls: type[Record], kw: dict[str, Any]) -> None:
    """Exact types of untrusted values, from the record's field tables (bool is not an int here)."""
    for name in cls.STR_FIELDS:
        if not isinstance(kw[name], str):
            raise InvalidExperience("wrong_type", f"{name} must be a string")
    for name in cls.INT_FIELDS:
        if name in kw and not _is_int(kw[name]):
            raise InvalidExperience("wrong_type", f"{name} must be an integer")
    for name in cls.FLOAT_FIELDS:
        if name in kw and not _is_num(kw[name]):
            raise InvalidExperience("wrong_type", f"{name} must be a number")
    for name, code in cls.ARRAY_ITEMS:
        v = kw[name]
        if not isinstance(v, list):
            raise InvalidExperience("wrong_type", f"{name} must be a list")
        allowed, what = (_INT_TYPES, "int") if code == "q" else (_NUM_TYPES, "float")
        if not allowed.issuperset(map(type, v)):  # exact types: bool is not an int here
            raise InvalidExperience("wrong_type", f"{name} must hold only {what}s")


def parse_row(row: Any, limits: ExperienceLimits = DEFAULT_LIMITS) -> Record:
    """Validate one record sent in storage form (``[kind, record_id, scalars, packed arrays]``, the
    compact wire format of :func:`~mutualrl.experience.records.to_row`) by an untrusted client.

    The same rules as :func:`parse`: exact field types, sizes and every value check, and the id is
    recomputed from the content (a ``record_id`` of None means "derive it"). Never raises anything
    but :class:`InvalidExperience`.
    """
    try:
        return _parse_row(row, limits)
    except InvalidExperience:
        raise
    except (TypeError, ValueError, OverflowError, KeyError, AttributeError, UnicodeError, RecursionError) as exc:
        raise InvalidExperience("bad_encoding", f"{type(exc).__name__} while reading the row") from None


def _parse_row(row: Any, limits: ExperienceLimits) -> Record:
    if not isinstance(row, (list, tuple)) or len(row) != 4:
        raise InvalidExperience("bad_encoding", "a row is [kind, record_id, scalars, arrays]")
    kind, rid, scalars, arrays = row
    if not isinstance(kind, str) or kind not in RECORD_TYPES:
        raise InvalidExperience("unknown_kind", f"kind {_short(kind)} is not one of {list(KINDS)}")
    cls = RECORD_TYPES[kind]
    if rid is not None and not isinstance(rid, str):
        raise InvalidExperience("bad_id", "record_id must be a string")
    if not isinstance(scalars, (list, tuple)) or len(scalars) != len(cls.SCALAR_FIELDS):
        raise InvalidExperience("wrong_type", f"{kind} has {len(cls.SCALAR_FIELDS)} scalar fields")
    if not isinstance(arrays, (bytes, bytearray)) or len(arrays) > limits.max_record_bytes:
        raise InvalidExperience("wrong_type" if not isinstance(arrays, (bytes, bytearray)) else "too_large",
                                "the numeric lists must be packed bytes within the record size cap")
    for x in scalars:
        if isinstance(x, (list, tuple, dict)):
            raise InvalidExperience("too_deep", "a scalar field holds a container")
    kwargs: dict[str, Any] = dict(zip(cls.SCALAR_FIELDS, scalars, strict=True))
    _check_types(cls, {**kwargs, **{name: [] for name, _ in cls.ARRAY_ITEMS}})
    items = cls.ARRAY_ITEMS
    packed: list[bytes] = []
    if items:
        if len(arrays) % (8 * len(items)):
            raise InvalidExperience("length_mismatch", "packed lists of unequal or partial length")
        size = len(arrays) // len(items)
        if size // 8 > max(limits.max_tokens, limits.max_group_size):
            raise InvalidExperience("too_large", f"{size // 8} values per list")
        for i, (name, code) in enumerate(items):
            packed.append(bytes(arrays[i * size:(i + 1) * size]))
            kwargs[name] = unpack_array(packed[-1], code)  # exact int64 / float64 values: no type to check
    elif arrays:
        raise InvalidExperience("length_mismatch", f"{kind} has no numeric lists")
    try:
        record = cls(**kwargs)
    except OverflowError:
        raise InvalidExperience("non_finite", "a number is too large for a float") from None
    record.__dict__["packed_arrays"] = tuple(packed)  # what packing the decoded values gives, byte for byte
    validate(record, limits)
    if rid is not None and rid != record.record_id:
        raise InvalidExperience("bad_id", "record_id does not match the record's content")
    return record
