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

from mutualrl.errors import UserError
from mutualrl.exchange.base import Exchange, PublishResult
from mutualrl.exchange.memory import MemoryExchange
from mutualrl.exchange.sqlite import SQLiteExchange
from mutualrl.exchange.url import ExchangeURL
from mutualrl.experience import ExperienceLimits

__all__ = ["Exchange", "ExchangeURL", "MemoryExchange", "PublishResult", "SQLiteExchange", "open_exchange"]

_NAMED_MEMORY: dict[str, MemoryExchange] = {}
_NAMED_LOCK = threading.Lock()


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
    parsed = ExchangeURL.from_str(url)
    scheme, where, opts = parsed.scheme, parsed.where, parsed.option_dict
    if scheme == "sqlite":
        retain = _int_opt(url, opts, "retain_versions")
        sync = opts.pop("synchronous", "normal").lower()
        try:
            busy = float(opts.pop("busy_timeout_s", "60"))
        except ValueError:
            raise UserError(f"exchange URL {url!r}: busy_timeout_s must be a number") from None
        _no_more(url, opts, "synchronous, retain_versions, busy_timeout_s")
        return SQLiteExchange(where, limits, synchronous=sync, busy_timeout_s=busy, retain_versions=retain)
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
        return RayExchange(where, store, limits, detached=detached, namespace=namespace)
    raise AssertionError(scheme)  # pragma: no cover - ExchangeURL knows only these schemes
