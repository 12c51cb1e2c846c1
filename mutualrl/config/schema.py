"""Plain data (YAML, JSON) into typed dataclasses, field by field, naming the bad field.

:func:`build` walks a dataclass's type hints: unknown fields get a "did you mean" hint, values of
the wrong type name the expected type and show the value. Nested dataclasses, lists, optional
and ``Literal`` fields are supported; a dataclass naming one of its mapping fields in
``__open_field__`` collects the keys that are not fields (mappings) into it. A numeric field declares its own bounds with
:func:`bounded` (``field(default=..., metadata=bounds(ge=...))``), and :func:`check_bounds` checks
a whole tree of dataclasses against them, naming the dotted path of the first value outside.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from mutualrl.errors import ConfigError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, path)
            except ConfigError:
                continue
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, f"expected one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        (inner,) = typing.get_args(tp)
        return [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a numeric field must lie in: ``ge``/``gt`` below, ``le``/``lt`` above (None: open)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value: float) -> str | None:
        """What is wrong with ``value`` ("must be >= 2"), or None."""
        for _, limit, ok in ((">=", self.ge, lambda v, x: v >= x), (">", self.gt, lambda v, x: v > x),
                              ("<=", self.le, lambda v, x: v <= x), ("<", self.lt, lambda v, x: v < x)):
            if limit is not None and not ok(value, limit):
                return f"must be {self.describe()}, got {value!r}"
        return None

    def describe(self) -> str:
        """The range in words, e.g. ``in (0, 1]`` or ``>= 2``."""
        lo = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        hi = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if lo and hi:
            return f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
        if lo:
            return f"{'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
        if hi:
            return f"{'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
        return "any number"


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def bounds(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> dict[str, Bounds]:
    """Field metadata declaring a numeric field's range: ``field(default=8, metadata=bounds(ge=2))``."""
    return {"bounds": Bounds(ge, gt, le, lt)}


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None) -> Any:
    """A dataclass field with a default and declared bounds (None values are never checked)."""
    return dataclasses.field(default=default, metadata=bounds(ge=ge, gt=gt, le=le, lt=lt))


def check_bounds(obj: Any, path: str = "") -> None:
    """Check every bounded field of dataclass ``obj`` and of the dataclasses under it (in fields and
    lists); raise :class:`ConfigError` naming the dotted path of the first value outside its range."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sub = f"{path}.{f.name}" if path else f.name
        b = f.metadata.get("bounds")
        if b is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            problem = b.violation(value)
            if problem:
                raise ConfigError(sub, problem)
        if dataclasses.is_dataclass(value):
            check_bounds(value, sub)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_bounds(item, f"{sub}[{i}]")


def build(cls: type, data: Any, path: str = "") -> Any:
    """An instance of dataclass ``cls`` from ``data`` (a mapping); ``path`` prefixes field names in errors."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(path or "<root>", f"expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    open_field = getattr(cls, "__open_field__", None)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key == open_field:  # the open mapping given as itself (a config read back from to_dict's asdict)
            extra.update(_coerce(hints[key], value, sub))
            continue
        if key not in names:
            if open_field is not None and isinstance(value, dict) and isinstance(key, str):
                extra[key] = dict(value)  # a block of the open mapping; its owner checks it
                continue
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(names)}"
            raise ConfigError(sub, f"unknown field{hint}")
        kwargs[key] = _coerce(hints[key], value, sub)
    if open_field is not None:
        kwargs[open_field] = extra
    return cls(**kwargs)


# ----------------------------------------------------------------------------- freezing
class FrozenError(dataclasses.FrozenInstanceError):
    """A field of a frozen config was set (a resolved plan's config never changes: build a new one)."""


class FrozenList(list):
    """A list that refuses to change (a frozen config's list fields)."""

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise FrozenError("a resolved config's lists do not change: build a new config (dataclasses.replace)")

    append = extend = insert = pop = remove = clear = sort = reverse = __setitem__ = __delitem__ = _refuse
    __iadd__ = __imul__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenList, (list(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:

        return [copy.deepcopy(v, memo) for v in self]  # a copy is the caller's to change


class FrozenDict(dict):
    """A dict that refuses to change (a frozen config's mapping fields)."""

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise FrozenError("a resolved config's mappings do not change: build a new config (dataclasses.replace)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:

        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


class Freezable:
    """A dataclass base whose instances can be frozen in place (:func:`freeze`): a frozen one refuses
    to have a field set, and its lists and mappings refuse to change, all the way down."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise FrozenError(f"{type(self).__name__}.{name}: a resolved config does not change; build a new one "
                              "(dataclasses.replace, or resolve the changed data)")
        object.__setattr__(self, name, value)


def _frozen_value(value: Any) -> Any:
    if isinstance(value, Freezable):
        return freeze(value)
    if isinstance(value, dict):
        return FrozenDict({k: _frozen_value(v) for k, v in value.items()})
    if isinstance(value, list):
        return FrozenList(_frozen_value(v) for v in value)
    return value


def freeze(obj: Any) -> Any:
    """Freeze dataclass ``obj`` (a :class:`Freezable`) and everything under it, in place; returns it."""
    if obj.__dict__.get("_frozen"):
        return obj
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, _frozen_value(getattr(obj, f.name)))
    object.__setattr__(obj, "_frozen", True)
    return obj


def thaw(value: Any) -> Any:
    """Plain, changeable copies of frozen lists and mappings (what ``asdict`` hands on)."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [thaw(v) for v in value]
    return value
