"""Overrides of a config's fields from the command line (``--set policies.0.grpo.learning_rate=3e-5``):
dotted paths into the config, values read as YAML scalars."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from mutualrl.errors import ConfigError, UserError


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "policies.0.grpo.learning_rate=3e-5"]`` -> ``{"a.b": 1, ...}``; values are read
    as YAML scalars (numbers, booleans, null, strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--set expects FIELD=VALUE (e.g. policies.0.grpo.learning_rate=3e-5), got {item!r}")
        out[key.strip()] = _scalar(text)
    return out


def _scalar(text: str) -> Any:
    """A command-line value: a number (``3e-5`` too, which YAML 1.1 reads as text), else YAML."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``data`` with each dotted ``field.sub.N.leaf`` of ``overrides`` set (list
    items by index); ``ConfigError`` naming the path when it runs through something that is not a
    mapping or a list, or past a list's end."""
    out = copy.deepcopy(dict(data))
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node: Any = out
        for depth, key in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth + 1])
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise ConfigError(where, f"list index out of range (the list has {len(node)} items)")
                if last:
                    node[int(key)] = value
                else:
                    node = node[int(key)]
            elif isinstance(node, dict):
                if last:
                    node[key] = value
                else:
                    node = node.setdefault(key, {})
            else:
                raise ConfigError(where, f"cannot set a field inside {type(node).__name__} value {node!r}")
    return out
