"""``ray://name`` — the exchange as a named Ray actor, for multi-process and multi-node runs.

The actor holds an ordinary store (``memory://`` by default, or the ``store=`` URL, e.g.
``ray://see?store=sqlite:////data/see.db``) and serialises all access to it. Every process that
opens ``ray://name`` in the same Ray cluster gets a handle to the same actor (get-or-create by
name in the ``mutualrl`` namespace). Records go to the actor as msgpack (or JSON) bytes and come back
as tuples of strings, numbers and bytes (storage form); no record object is pickled, and the actor
parses and validates everything it is sent, so a buggy or hostile client cannot poison the store.

URL options: ``store=<url>`` (backing store), ``detached=1`` (outlive the creating driver),
``namespace=<ns>`` (default ``mutualrl``). The actor is pinned to the node that creates it, so a
``sqlite`` store's path refers to that node's disk. The first opener's limits apply.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from mutualrl.errors import UserError
from mutualrl.exchange.base import _RECORD_CLASSES, Exchange, PublishResult, Query, gc_paused
from mutualrl.exchange.local import open_local_exchange
from mutualrl.experience import (
    DEFAULT_LIMITS,
    ExperienceLimits,
    InvalidExperience,
    Record,
    StoredRow,
    parse,
)

try:
    import msgpack  # a Ray dependency; faster than JSON for numeric lists

    _HAVE_MSGPACK = True
except ImportError:  # pragma: no cover
    _HAVE_MSGPACK = False

ACTOR_PREFIX = "mutualrl-exchange:"
_KEEP: dict[tuple[str, str, str], Any] = {}  # (job, namespace, name) -> a handle kept alive here
DEFAULT_NAMESPACE = "mutualrl"


class ExchangeActor:
    """The actor body: wraps a local store; takes msgpack/JSON lines, returns rows in storage form."""

    def __init__(self, store_url: str, limits: dict[str, Any]) -> None:
        self._ex = open_local_exchange(store_url, ExperienceLimits.from_dict(limits))

    def publish_lines(self, lines: list[str | bytes]) -> dict[str, Any]:
        """Parse, validate and store lines (see :meth:`Exchange.publish_json`)."""
        return self._ex.publish_json(lines).to_dict()

    @gc_paused()
    def publish_rows(self, blob: bytes) -> dict[str, Any]:
        """Parse, validate and store a msgpack list of rows in storage form (one round trip per batch)."""
        n = len(blob)  # no container or string can be larger than the message itself
        try:
            rows = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_str_len=n, max_bin_len=n,
                                   max_array_len=n, max_map_len=n, max_ext_len=n)
        except Exception:  # noqa: BLE001 - garbage from a client: the whole batch is unreadable
            return PublishResult(0, 0, {"bad_encoding": 1}).to_dict()
        if not isinstance(rows, list):
            return PublishResult(0, 0, {"bad_encoding": 1}).to_dict()
        return self._ex.publish_rows(rows).to_dict()

    @gc_paused()
    def read(self, query: dict[str, Any]) -> list[StoredRow]:
        """Matching records in storage form (plain strings, numbers and bytes)."""
        return self._ex.read(Query.from_dict(query))

    def advance(self, step: int) -> int:
        """See :meth:`Exchange.advance`."""
        return self._ex.advance(step)

    def prune(self, older_than_version: int) -> int:
        """See :meth:`Exchange.prune`."""
        return self._ex.prune(older_than_version)

    def discard_after(self, position: int) -> int:
        """See :meth:`Exchange.discard_after`."""
        return self._ex.discard_after(position)

    def stats(self) -> dict[str, Any]:
        """See :meth:`Exchange.stats`."""
        return self._ex.stats()


def _encode_one(r: Record) -> bytes | str:
    try:
        return r.to_msgpack() if _HAVE_MSGPACK else r.to_json()
    except (ValueError, OverflowError, TypeError):  # unencodable: the actor counts it
        return b"\xc1"


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

    @gc_paused()
    def publish(self, records: Iterable[Record]) -> PublishResult:
        """Send records to the actor in one msgpack batch of storage-form rows (the actor parses
        and validates each row and recomputes its id; see :meth:`Exchange.publish`)."""
        records = list(records)
        rows = []
        for r in records:
            if not isinstance(r, _RECORD_CLASSES):
                raise TypeError(f"publish() takes experience records, got {type(r).__name__}")
            # the id is sent only when the record claims one: the actor derives it from the content
            rows.append([r.kind, r.__dict__.get("record_id"), [getattr(r, n) for n in r.SCALAR_FIELDS],
                         b"".join(r.packed_arrays)])
        if not _HAVE_MSGPACK:  # pragma: no cover - msgpack ships with Ray
            return PublishResult.from_dict(self._call("publish_lines", [r.to_json() for r in records]))

        try:
            blob = msgpack.packb(rows, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):  # an unencodable value: the actor counts it per row
            return PublishResult.from_dict(self._call("publish_lines", [_encode_one(r) for r in records]))
        return PublishResult.from_dict(self._call("publish_rows", blob))

    def publish_json(self, lines: Iterable[str | bytes | dict]) -> PublishResult:
        """Forward untrusted lines to the actor, which parses and validates each one.

        Decoded objects (dicts) are parsed here first (nothing about them can make this raise) and
        sent as the validated record's wire form; the actor validates again."""
        out: list[str | bytes] = []
        local: Counter[str] = Counter()
        for line in lines:
            if isinstance(line, dict):
                try:
                    rec = parse(line, self.limits)
                    out.append(rec.to_msgpack() if _HAVE_MSGPACK else rec.to_json())
                except InvalidExperience as exc:
                    local[exc.reason] += 1
            elif isinstance(line, (str, bytes)):
                out.append(line)
            elif isinstance(line, (bytearray, memoryview)):
                out.append(bytes(line))
            else:
                local["bad_encoding"] += 1
        result = PublishResult.from_dict(self._call("publish_lines", out))
        if local:
            result = result + PublishResult(0, 0, dict(local))
        return result

    def _store(self, records: list[Record], rejected: dict[str, int]) -> PublishResult:
        raise NotImplementedError  # publish/publish_json are overridden

    def read(self, query: Query) -> list[StoredRow]:
        """See :meth:`Exchange.read` (the actor runs the query on its store)."""
        if query.empty:
            return []
        return [tuple(row) for row in self._call("read", query.to_dict())]  # type: ignore[misc]

    def advance(self, step: int) -> int:
        """See :meth:`Exchange.advance` (the actor's store keeps the clock)."""
        self.clock = int(self._call("advance", int(step)))
        return self.clock

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
