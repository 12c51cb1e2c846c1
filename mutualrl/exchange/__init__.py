"""SEE, the Shared Experience Exchange: open one with :func:`open_exchange`.

URLs:

* ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db`` — the durable embedded
  default; options ``synchronous=normal|full``, ``retain_versions=K``, ``busy_timeout_s=S``.
* ``memory://`` — a fresh in-process store; ``memory://name`` is shared by name within the
  process. Option ``retain_versions=K``.
* ``ray://name`` — a named Ray actor holding a store; options ``store=<url>``, ``detached=1``,
  ``namespace=<ns>``.
"""

from __future__ import annotations

import threading
from urllib.parse import parse_qsl

from mutualrl.errors import UserError
from mutualrl.exchange.base import Exchange, PublishResult
from mutualrl.exchange.memory import MemoryExchange
from mutualrl.exchange.sqlite import SQLiteExchange
from mutualrl.experience import ExperienceLimits

__all__ = ["Exchange", "MemoryExchange", "PublishResult", "SQLiteExchange", "open_exchange"]

_NAMED_MEMORY: dict[str, MemoryExchange] = {}
_NAMED_LOCK = threading.Lock()
_EXAMPLES = "sqlite:///runs/see.db, sqlite:////abs/see.db, memory://, ray://see"


def _split(url: str) -> tuple[str, str, dict[str, str]]:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise UserError(f"exchange URL {url!r} has no scheme; use one of: {_EXAMPLES}")
    where, _, query = rest.partition("?")
    try:
        opts = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError as exc:
        raise UserError(f"exchange URL {url!r} has a malformed query string: {exc}") from exc
    return scheme.lower(), where, opts


def _int_opt(url: str, opts: dict[str, str], key: str) -> int | None:
    if key not in opts:
        return None
    try:
        v = int(opts.pop(key))
    except ValueError:
        raise UserError(f"exchange URL {url!r}: {key} must be an integer") from None
    if v < 1:
        raise UserError(f"exchange URL {url!r}: {key} must be >= 1")
    return v


def _no_more(url: str, opts: dict[str, str], known: str) -> None:
    if opts:
        raise UserError(f"exchange URL {url!r}: unknown option(s) {sorted(opts)}; known: {known}")


def open_exchange(url: str, limits: ExperienceLimits | None = None) -> Exchange:
    """Open (creating if needed) the exchange at ``url``; see the module doc for URL forms.

    Raises :class:`~mutualrl.errors.UserError` for a malformed URL, an unknown scheme, or a
    database that cannot be opened (the message names the path and what to do).
    """
    if not isinstance(url, str):
        raise UserError(f"exchange URL must be a string, got {type(url).__name__}")
    scheme, where, opts = _split(url)
    if scheme == "sqlite":
        retain = _int_opt(url, opts, "retain_versions")
        sync = opts.pop("synchronous", "normal").lower()
        try:
            busy = float(opts.pop("busy_timeout_s", "60"))
        except ValueError:
            raise UserError(f"exchange URL {url!r}: busy_timeout_s must be a number") from None
        _no_more(url, opts, "synchronous, retain_versions, busy_timeout_s")
        if not where.startswith("/") or where == "/":
            raise UserError(f"exchange URL {url!r} needs a file path: sqlite:///relative.db or "
                            "sqlite:////absolute/path.db")
        path = where[1:]
        return SQLiteExchange(path, limits, synchronous=sync, busy_timeout_s=busy, retain_versions=retain)
    if scheme == "memory":
        retain = _int_opt(url, opts, "retain_versions")
        _no_more(url, opts, "retain_versions")
        if not where:
            return MemoryExchange(limits, retain)
        with _NAMED_LOCK:
            if where not in _NAMED_MEMORY:
                _NAMED_MEMORY[where] = MemoryExchange(limits, retain)
            return _NAMED_MEMORY[where]
    if scheme == "ray":
        from mutualrl.exchange.ray import DEFAULT_NAMESPACE, RayExchange

        store = opts.pop("store", "memory://")
        detached = opts.pop("detached", "0").lower() in ("1", "true", "yes")
        namespace = opts.pop("namespace", DEFAULT_NAMESPACE)
        _no_more(url, opts, "store, detached, namespace")
        if not where or "/" in where:
            raise UserError(f"exchange URL {url!r} needs a plain actor name, e.g. ray://see")
        return RayExchange(where, store, limits, detached=detached, namespace=namespace)
    raise UserError(f"unknown exchange scheme {scheme!r} in {url!r}; use one of: {_EXAMPLES}")
