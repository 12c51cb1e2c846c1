"""``ray://name`` — the exchange as a named Ray actor, for multi-process and multi-node runs.

The actor holds an ordinary store (``memory://`` by default, or the ``store=`` URL, e.g.
``ray://see?store=sqlite:////data/see.db``) and serialises all access to it. Every process that
opens ``ray://name`` in the same Ray cluster gets a handle to the same actor (get-or-create by
name in the ``mutualrl`` namespace). Records travel as msgpack maps (or JSON text), never as
pickled objects, and the actor validates everything it is sent, so a buggy client cannot poison the store.

URL options: ``store=<url>`` (backing store), ``detached=1`` (outlive the creating driver),
``namespace=<ns>`` (default ``mutualrl``). The actor is pinned to the node that creates it, so a
``sqlite`` store's path refers to that node's disk. The first opener's limits apply.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from mutualrl.errors import UserError
from mutualrl.exchange.base import Exchange, PublishResult, check_kinds
from mutualrl.experience import (
    DEFAULT_LIMITS,
    RECORD_TYPES,
    ExperienceLimits,
    Record,
    StoredRow,
    from_row,
)

try:
    import msgpack  # noqa: F401  (a Ray dependency; faster than JSON for numeric lists)

    _HAVE_MSGPACK = True
except ImportError:  # pragma: no cover
    _HAVE_MSGPACK = False

ACTOR_PREFIX = "mutualrl-exchange:"
_KEEP: dict[tuple[str, str, str], Any] = {}  # (job, namespace, name) -> a handle kept alive here
DEFAULT_NAMESPACE = "mutualrl"


class ExchangeActor:
    """The actor body: wraps a local store and speaks JSON text with its clients."""

    def __init__(self, store_url: str, limits: dict[str, Any]) -> None:
        from mutualrl.exchange import open_exchange

        self._ex = open_exchange(store_url, ExperienceLimits.from_dict(limits))

    def publish_lines(self, lines: list[str | bytes]) -> dict[str, Any]:
        """Parse, validate and store lines (see :meth:`Exchange.publish_json`)."""
        return self._ex.publish_json(lines).to_dict()

    def query_stored(self, prompt_ids: list[str], kinds: list[str] | None, exclude_source: str | None,
                     min_version: int | None, limit: int | None) -> list[StoredRow]:
        """Matching records in storage form (plain strings, numbers and bytes)."""
        return self._ex.query_stored(prompt_ids, kinds, exclude_source, min_version, limit)

    def prune(self, older_than_version: int) -> int:
        """See :meth:`Exchange.prune`."""
        return self._ex.prune(older_than_version)

    def discard_after(self, position: int) -> int:
        """See :meth:`Exchange.discard_after`."""
        return self._ex.discard_after(position)

    def stats(self) -> dict[str, Any]:
        """See :meth:`Exchange.stats`."""
        return self._ex.stats()


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise UserError("ray:// exchanges need Ray: pip install 'mutualrl[ray]'") from exc
    return ray


class RayExchange(Exchange):
    """Client handle of a named exchange actor (get-or-create).

    Args:
        name: the actor's name; every process in the cluster that uses it shares one exchange.
        store_url: backing store inside the actor (``memory://`` or ``sqlite:///...``).
        limits: validation limits, applied by the actor if this call creates it.
        detached: let the actor outlive the driver that created it (then ``destroy()`` ends it).
        namespace: Ray namespace of the actor.
    """

    def __init__(
        self,
        name: str,
        store_url: str = "memory://",
        limits: ExperienceLimits | None = None,
        detached: bool = False,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        ray = _import_ray()
        if not name:
            raise UserError("ray:// exchange needs a name, e.g. ray://see")
        if store_url.startswith("ray:"):
            raise UserError("a ray:// exchange cannot be backed by another ray:// exchange")
        self.name = name
        self.limits = limits or DEFAULT_LIMITS
        if not ray.is_initialized():
            ray.init()  # joins RAY_ADDRESS / a local `ray start` cluster if there is one
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        actor_cls = ray.remote(ExchangeActor)
        self._actor = actor_cls.options(
            name=ACTOR_PREFIX + name,
            namespace=namespace,
            get_if_exists=True,
            lifetime="detached" if detached else None,
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote(store_url, self.limits.to_dict())
        self._ray = ray
        self._key = (ray.get_runtime_context().get_job_id(), namespace, name)
        # Ray ends a non-detached actor once no handle to it is left; keep one per process so
        # that close() + reopen does not lose a memory:// store. destroy() ends it for real.
        _KEEP.setdefault(self._key, self._actor)

    def _call(self, method: str, *args: Any) -> Any:
        return self._ray.get(getattr(self._actor, method).remote(*args))

    def publish(self, records: Iterable[Record]) -> PublishResult:
        """Send records to the actor as JSON (the actor validates; see :meth:`Exchange.publish`)."""
        lines = []
        for r in records:
            if not isinstance(r, tuple(RECORD_TYPES.values())):
                raise TypeError(f"publish() takes experience records, got {type(r).__name__}")
            try:
                lines.append(r.to_msgpack() if _HAVE_MSGPACK else r.to_json())
            except (ValueError, OverflowError, TypeError):  # unencodable: the actor counts it
                lines.append(b"\xc1")
        return PublishResult.from_dict(self._call("publish_lines", lines))

    def publish_json(self, lines: Iterable[str | bytes | dict]) -> PublishResult:
        """Forward untrusted lines to the actor, which parses and validates each one."""
        out: list[str | bytes] = []
        local_bad = 0
        for line in lines:
            if isinstance(line, dict):
                try:
                    out.append(json.dumps(line))
                except (TypeError, ValueError):
                    local_bad += 1
            elif isinstance(line, (str, bytes)):
                out.append(line)
            elif isinstance(line, (bytearray, memoryview)):
                out.append(bytes(line))
            else:
                local_bad += 1
        result = PublishResult.from_dict(self._call("publish_lines", out))
        if local_bad:
            result = result + PublishResult(0, 0, {"bad_encoding": local_bad})
        return result

    def _store(self, records: list[Record], rejected: dict[str, int]) -> PublishResult:
        raise NotImplementedError  # publish/publish_json are overridden

    def query(
        self,
        prompt_ids: Sequence[str],
        kinds: Iterable[str] | None = None,
        exclude_source: str | None = None,
        min_version: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`Exchange.query`."""
        ks = list(check_kinds(kinds))
        rows = self._call("query_stored", list(prompt_ids), ks, exclude_source, min_version, limit)
        return [from_row(*row) for row in rows]

    def prune(self, older_than_version: int) -> int:
        """See :meth:`Exchange.prune`."""
        return int(self._call("prune", older_than_version))

    def discard_after(self, position: int) -> int:
        """See :meth:`Exchange.discard_after`."""
        return int(self._call("discard_after", position))

    def stats(self) -> dict[str, Any]:
        """See :meth:`Exchange.stats`; adds ``ray_name``."""
        return {**self._call("stats"), "ray_name": self.name}

    def close(self) -> None:
        """Drop this handle; the actor lives on for other clients (see :meth:`destroy`)."""
        self._actor = None

    def destroy(self) -> None:
        """Kill the actor (and with a ``memory://`` store, its data)."""
        if self._actor is not None:
            self._ray.kill(self._actor)
            self._actor = None
        _KEEP.pop(self._key, None)
