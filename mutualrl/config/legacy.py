"""The flat ``sharing.*`` names of earlier releases (``sgt_lambda``, ``prp_ratio_clip``, ...), moved
into the ``sharing.<step>:`` blocks that own them now, with one ``FutureWarning`` naming the new fields.
They go in release 0.3.0 (CHANGELOG.md)."""

from __future__ import annotations

import warnings
from typing import Any

from mutualrl.errors import ConfigError

LEGACY_SHARING: dict[str, tuple[str, tuple[str, ...]]] = {
    "sgt_lambda": ("weight", ("sgt", "imitate", "self_imitate")),
    "sgt_max_per_step": ("max_rows", ("sgt", "imitate")),
    "sgt_replay_own": ("replay_own", ("sgt",)),
    "sgt_learning_rate": ("learning_rate", ("sgt", "imitate", "self_imitate")),
    "prp_ratio_clip": ("ratio_clip", ("prp",)),
    "prp_max_peer_per_prompt": ("max_per_prompt", ("prp",)),
    "prp_peer_weight": ("weight", ("prp",)),
    "guide_max_per_group": ("max_per_group", ("guide",)),
    "guide_gate": ("gate", ("guide",)),
    "guide_weight": ("weight", ("guide",)),
    "guide_shaping_gamma": ("shaping_gamma", ("guide",)),
    "replay_steps": ("replay_steps", ("imitate",)),
}
"""The flat ``sharing.*`` names of earlier releases -> (the field, the steps whose block it moves to);
they still work for this release, with a warning naming the new field."""


def move_legacy_sharing(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config mapping) with the flat sharing names of earlier releases moved into the
    step blocks they belong to, one ``FutureWarning`` naming the new fields."""
    sharing = data.get("sharing")
    if not isinstance(sharing, dict) or not set(sharing) & set(LEGACY_SHARING):
        return data
    sharing = dict(sharing)
    moved = []
    for old, (name, steps) in LEGACY_SHARING.items():
        if old not in sharing:
            continue
        value = sharing.pop(old)
        for step in steps:
            block = sharing.get(step, {})
            if not isinstance(block, dict):
                raise ConfigError(f"sharing.{step}", f"expected a mapping of {step}'s settings, got {block!r}")
            if name in block and block[name] != value:
                raise ConfigError(f"sharing.{old}", f"give either sharing.{old} (deprecated) or sharing.{step}.{name}, "
                                  "not both")
            sharing[step] = {**block, name: value}
        moved.append(f"sharing.{old} -> " + " / ".join(f"sharing.{st}.{name}" for st in steps))
    warnings.warn("deprecated sharing fields (they go in release 0.3.0): " + "; ".join(moved), FutureWarning,
                  stacklevel=3)
    return {**data, "sharing": sharing}
