"""Opening the exchanges that live in this process: ``sqlite://`` (durable) and ``memory://``.

The Ray exchange's actor opens its backing store through this too, so nothing here imports Ray.
"""

from __future__ import annotations

import threading

from mutualrl.errors import UserError
from mutualrl.exchange.base import Exchange
from mutualrl.exchange.memory import MemoryExchange
from mutualrl.exchange.sqlite import SQLiteExchange
from mutualrl.exchange.url import ExchangeURL
from mutualrl.experience import ExperienceLimits

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


def no_more_options(url: str, opts: dict[str, str], known: str) -> None:
    if opts:
        raise UserError(f"exchange URL {url!r}: unknown option(s) {sorted(opts)}; known: {known}")


def open_local_exchange(url: str, limits: ExperienceLimits | None = None) -> Exchange:
    """Open (creating if needed) a ``sqlite://`` or ``memory://`` exchange (see :func:`open_exchange`).

    Raises :class:`~mutualrl.errors.UserError` for a malformed URL, another scheme, or a database
    that cannot be opened (the message names the path and what to do).
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
        no_more_options(url, opts, "synchronous, retain_versions, busy_timeout_s")
        return SQLiteExchange(where, limits, synchronous=sync, busy_timeout_s=busy, retain_versions=retain)
    if scheme == "memory":
        retain = _int_opt(url, opts, "retain_versions")
        no_more_options(url, opts, "retain_versions")
        if not where:
            return MemoryExchange(limits, retain)
        with _NAMED_LOCK:
            if where not in _NAMED_MEMORY:
                _NAMED_MEMORY[where] = MemoryExchange(limits, retain)
            return _NAMED_MEMORY[where]
    raise UserError(f"exchange URL {url!r}: {scheme}:// is not a local exchange (sqlite:// or memory://)")
