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

from mutualrl.exchange.base import Exchange, PublishResult
from mutualrl.exchange.local import no_more_options, open_local_exchange
from mutualrl.exchange.memory import MemoryExchange
from mutualrl.exchange.sqlite import SQLiteExchange
from mutualrl.exchange.url import ExchangeURL
from mutualrl.experience import ExperienceLimits

__all__ = ["Exchange", "ExchangeURL", "MemoryExchange", "PublishResult", "SQLiteExchange", "open_exchange"]


def open_exchange(url: str, limits: ExperienceLimits | None = None) -> Exchange:
    """Open (creating if needed) the exchange at ``url``; see the module doc for URL forms.

    Raises :class:`~mutualrl.errors.UserError` for a malformed URL, an unknown scheme, or a
    database that cannot be opened (the message names the path and what to do).
    """
    parsed = ExchangeURL.from_str(url)
    if parsed.scheme != "ray":
        return open_local_exchange(url, limits)
    from mutualrl.exchange.ray import DEFAULT_NAMESPACE, RayExchange  # lazy: Ray is an optional extra

    opts = parsed.option_dict
    store = opts.pop("store", "memory://")
    detached = opts.pop("detached", "0").lower() in ("1", "true", "yes")
    namespace = opts.pop("namespace", DEFAULT_NAMESPACE)
    no_more_options(url, opts, "store, detached, namespace")
    return RayExchange(parsed.where, store, limits, detached=detached, namespace=namespace)
