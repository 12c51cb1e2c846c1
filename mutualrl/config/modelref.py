"""Model references in configs: one parser for ``zoo:NAME[@SEED]``, ``real:NAME``, a directory or a hub id.

``ModelRef.parse`` turns the string into a typed reference (and is the only place that knows the
syntax); ``ModelRef.resolve`` turns it into something ``from_pretrained`` loads, building a zoo
policy or preparing a real model on demand.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mutualrl.realmodels import MODELS, prepare, prepared_dir

RefKind = Literal["zoo", "real", "dir", "hub"]


class ModelRefError(ValueError):
    """A model reference that does not parse or names nothing known; the message says what is valid."""


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference.

    ``kind`` is ``zoo`` (``name`` a zoo policy, ``seed`` its build seed), ``real`` (``name`` a
    real-model preset entry), ``dir`` (``name`` a local directory, ``~`` expanded) or ``hub``
    (``name`` a hub id; loading it needs the network).
    """

    kind: RefKind
    name: str
    seed: int = 0

    @classmethod
    def parse(cls, ref: str) -> ModelRef:
        """Parse ``ref``; raises :class:`ModelRefError` for an empty reference, an unknown zoo or
        real name (with the closest one) or a zoo seed that is not an integer."""
        ref = (ref or "").strip()
        if not ref:
            raise ModelRefError("empty model reference: use zoo:<name>, real:<name>, a local directory or a hub id")
        if ref.startswith("zoo:"):
            from mutualrl.zoo.specs import ZOO

            name, at, seed = ref[4:].partition("@")
            if at and not seed.isdigit():
                raise ModelRefError(f"zoo seed in {ref!r} must be a non-negative integer (zoo:NAME@SEED)")
            _known(name, list(ZOO), "zoo policy", "zoo:")
            return cls("zoo", name, int(seed or 0))
        if ref.startswith("real:"):
            _known(ref[5:], list(MODELS), "real model", "real:")
            return cls("real", ref[5:])
        p = Path(ref).expanduser()
        if ref.startswith((".", "/", "~")) or p.exists():
            return cls("dir", str(p))
        return cls("hub", ref)

    def __str__(self) -> str:
        if self.kind == "zoo":
            return f"zoo:{self.name}" + (f"@{self.seed}" if self.seed else "")
        return f"real:{self.name}" if self.kind == "real" else self.name

    def local_dir(self) -> Path | None:
        """Where the model lives or will be built, without building it (None for a hub id)."""
        if self.kind == "zoo":
            from mutualrl.zoo.build import policy_dir

            return policy_dir(self.name, self.seed)
        if self.kind == "real":
            return prepared_dir(self.name)
        return Path(self.name) if self.kind == "dir" else None

    def resolve(self, *, progress: bool = True) -> str:
        """A directory or hub id for ``from_pretrained``; zoo policies are built and real models
        prepared on demand (the zoo build seed comes from the reference, never the run)."""
        if self.kind == "zoo":
            from mutualrl.zoo.build import zoo_model_dir

            return str(zoo_model_dir(self.name, seed=self.seed, progress=progress))
        if self.kind == "real":
            return str(prepare(self.name, progress=progress))
        return self.name


def _known(name: str, valid: list[str], what: str, prefix: str) -> None:
    if name not in valid:
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
        raise ModelRefError(f"unknown {what} {name!r}{hint}; available: {', '.join(sorted(valid))}")


def resolve_model_path(ref: str) -> str:
    """``ModelRef.parse(ref).resolve()``: a directory or hub id for ``from_pretrained``."""
    return ModelRef.parse(ref).resolve(progress=sys.stderr.isatty())
