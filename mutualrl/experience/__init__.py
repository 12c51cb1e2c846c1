"""Typed experience records shared through SEE, their wire format and their validation.

Four record kinds, one per sharing level:

* :class:`Rollout` (data): a completion with its token trace, behavior log-probs and reward.
* :class:`GroupOutcome` (value): the rewards of one policy's group for a prompt, with mean/std.
* :class:`VerifiedSuccess` (outcome): a completion that a verifier accepted.
* :class:`PeerScore` (signal): a peer's chunk-level log-probs of another policy's completion.

Every record is a frozen dataclass with a ``kind``, a ``SCHEMA_VERSION`` and a content-derived
``record_id`` (sha256 over the canonical JSON of its content fields, with the numeric lists
hashed as packed little-endian values; see :attr:`Rollout.record_id`). Timestamps are not
content, so republishing the same experience later yields the same id.

Wire format: one JSON object per record (:meth:`to_json`), or one msgpack map
(:meth:`to_msgpack`, when ``msgpack`` is installed). Pickle is never used. Anything coming from a
peer goes through :func:`parse`, which validates everything and raises
:class:`InvalidExperience` with a short machine-readable ``reason`` code.
"""

from __future__ import annotations

from mutualrl.experience.limits import DEFAULT_LIMITS, REASONS, ExperienceLimits, InvalidExperience
from mutualrl.experience.parse import parse, parse_row
from mutualrl.experience.records import (
    KINDS,
    RECORD_TYPES,
    SCHEMA_VERSION,
    GroupOutcome,
    PeerScore,
    Record,
    Rollout,
    StoredRow,
    VerifiedSuccess,
    from_dict,
    from_row,
    pack_array,
    to_row,
    unpack_array,
)
from mutualrl.experience.validate import validate

__all__ = [
    "DEFAULT_LIMITS", "KINDS", "REASONS", "RECORD_TYPES", "SCHEMA_VERSION", "ExperienceLimits", "GroupOutcome",
    "InvalidExperience", "PeerScore", "Record", "Rollout", "StoredRow", "VerifiedSuccess", "from_dict", "from_row", "pack_array",
    "parse", "parse_row", "to_row", "unpack_array", "validate",
]
