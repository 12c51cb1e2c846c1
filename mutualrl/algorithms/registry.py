"""The strategy registry: sharing steps, what each declares about itself, and the one parser of a
strategy name (``xgrpo+sgt``).

A step is one function registered with :func:`register_strategy`, which declares everything the
rest of mutualrl needs to know of it, so nothing outside the step's module names it:

- ``settings``: its settings dataclass, read from ``sharing.<step>:`` (fields with declared bounds,
  checked by the same schema as the rest of the config);
- ``rows``: the kinds of training rows it adds, each with the registered loss term that trains it
  (:mod:`mutualrl.algorithms.losses`), its per-token weights and, when the step wants one, the
  learning rate of an optimizer step of its own (:class:`RowKind`);
- ``reads``: the record kinds it reads from the peers' rows of this step's prompts (the worker
  queries exactly those into ``ctx.peers``); ``gathers``: the kinds its ``gather`` hook fetches
  itself (a window of earlier steps, scores of its own samples), which the worker does not query
  again. Both count as reading the peers (a step with either needs two policies or more);
- ``needs`` / ``provides`` / ``breaks``: properties of the batch (e.g. ``own_groups``: the own rows
  intact, in group order; ``pooled_advantages``: own advantages over a group pooled with peers,
  which at most one step may provide). A chain is put in an order where every step finds what it
  needs, or refused;
- ``conflicts``, and ``peer_rollouts`` (how many peer rollouts per prompt it trains on: the
  resource plan prices them);
- ``gather``: a hook that fetches what the step needs beyond the step's own groups and peer rows
  (a replay of earlier steps, peers' scores) through the worker's
  :class:`~mutualrl.algorithms.context.StepSource`; the step reads it from ``ctx.gathered``;
- ``serve``: work a step does for its peers in a phase of its own, after every policy's rollouts
  and before the updates (``distill``: score the peers' samples with this policy's model); it
  returns records to publish and its metrics.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mutualrl.algorithms.batch import OWN  # noqa: F401  (the own rows' kind, re-exported beside the other names)
from mutualrl.algorithms.losses import LossTerm, loss_term
from mutualrl.config.schema import build, check_bounds
from mutualrl.experience import KINDS

if TYPE_CHECKING:
    import torch

BASE = "independent"
POLICY_PHASE = "policy"
"""The optimizer step every policy takes (the GRPO step at ``grpo.learning_rate``)."""
OWN_GROUPS = "own_groups"
"""Batch property: the own rows intact, in group order (what pooling steps rewrite advantages of)."""
POOLED_ADVANTAGES = "pooled_advantages"
"""Batch property: own advantages recomputed over groups pooled with peers' rewards."""
EXCLUSIVE: frozenset[str] = frozenset({POOLED_ADVANTAGES})
"""Properties at most one step of a chain may provide (two poolings would overwrite each other)."""

TokenWeightFn = Callable[[Sequence[Any], "torch.Tensor", int, Any], "tuple[torch.Tensor, dict[str, float]]"]
"""``(rows of the kind, their current log-probs [B, C] (no gradient), width, the step's settings)``
-> ``(per-token weights [B, C], statistics)``; called in every optimizer iteration."""


@dataclass(frozen=True)
class RowKind:
    """A kind of training row a step adds: the loss term that trains it and how."""

    loss: str
    """A registered loss term (:func:`mutualrl.algorithms.losses.register_loss`)."""
    weights: TokenWeightFn | None = None
    """Per-token weights of the kind's rows from their current log-probs (importance weights, policy
    shaping); none: the term's own (the mismatch correction for on-policy rows)."""
    learning_rate: Callable[[Any], float | None] | None = None
    """From the step's settings, the learning rate of an optimizer step of the kind's own (AdamW,
    after the policy's step); None: the rows join the policy's step."""


@dataclass(frozen=True)
class BoundKind:
    """A row kind with the settings of the step that declared it: what the update needs of it."""

    name: str
    step: str
    kind: RowKind
    settings: Any = None

    @property
    def term(self) -> LossTerm:
        return loss_term(self.kind.loss)

    @property
    def learning_rate(self) -> float | None:
        """The learning rate of the kind's own optimizer step, or None (the policy's step)."""
        return self.kind.learning_rate(self.settings) if self.kind.learning_rate is not None else None

    @property
    def phase(self) -> str:
        """The optimizer step the kind's rows train in: :data:`POLICY_PHASE` or the step's own."""
        return POLICY_PHASE if self.learning_rate is None else self.step

    def token_weights(self, rows: Sequence[Any], cur_logp: torch.Tensor, width: int
                      ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The kind's per-token weights for ``rows`` (None when it declares none)."""
        if self.kind.weights is None:
            return None, {}
        return self.kind.weights(rows, cur_logp, width, self.settings)


GatherFn = Callable[[Any, Any], Any]
"""``gather(source, settings)``: what a step fetches before the batch is built (``source`` a
:class:`~mutualrl.algorithms.context.StepSource`); None when it needs nothing this step."""

ServeFn = Callable[[Any, Any], "tuple[list[Any], dict[str, float]]"]
"""``serve(source, settings)``: the records a step publishes for its peers between the rollouts and
the updates, and its metrics (``scored_tokens``: forward tokens, priced as scoring FLOPs)."""

StrategyFn = Callable[..., None]
"""``fn(ctx, batch)``, or ``fn(ctx, batch, settings)`` for a step that declares ``settings``."""


@dataclass(frozen=True)
class StrategyStep:
    """A registered strategy step and what it declares about itself (see the module docstring)."""

    name: str
    apply: StrategyFn
    settings: type | None
    rows: Mapping[str, RowKind]
    reads: frozenset[str]
    needs: frozenset[str]
    provides: frozenset[str]
    breaks: frozenset[str]
    conflicts: frozenset[str]
    description: str = ""
    peer_rollouts: Callable[[Any], int] | None = None
    gather: GatherFn | None = None
    serve: ServeFn | None = None
    gathers: frozenset[str] = frozenset()

    def run(self, ctx: Any, batch: Any, settings: Any) -> None:
        """Apply the step (with its settings when it declares any)."""
        if self.settings is None:
            self.apply(ctx, batch)
        else:
            self.apply(ctx, batch, settings)

    def settings_from(self, value: Any) -> Any:
        """The step's settings from a ``sharing.<step>`` block (a mapping), an instance or nothing
        (its defaults); ``ConfigError`` naming ``sharing.<step>.<field>`` for a bad value."""
        if self.settings is None:
            return None
        if isinstance(value, self.settings):
            out = value
        else:
            out = build(self.settings, {} if value is None else value, f"sharing.{self.name}")
        check_bounds(out, f"sharing.{self.name}")
        return out


_REGISTRY: dict[str, StrategyStep] = {}
"""Registered steps by name (importing any module of :mod:`mutualrl.algorithms` runs the package's
``__init__``, which registers the built-in steps first)."""
_KIND_OWNER: dict[str, str] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_strategy(name: str, *, settings: type | None = None, rows: Mapping[str, RowKind] | None = None,
                      reads: Sequence[str] = (), needs: Sequence[str] = (), provides: Sequence[str] = (),
                      breaks: Sequence[str] = (), conflicts: Sequence[str] = (), description: str = "",
                      peer_rollouts: Callable[[Any], int] | None = None,
                      gather: GatherFn | None = None,
                      serve: ServeFn | None = None,
                      gathers: Sequence[str] = ()) -> Callable[[StrategyFn], StrategyFn]:
    """Register a strategy step under ``name`` (usable in ``sharing.strategy``, chained with '+').

    ``settings`` is a dataclass (fields made with :func:`mutualrl.config.schema.bounded`) read from the
    config's ``sharing.<name>:`` block; the step is then called as ``fn(ctx, batch, settings)``.
    ``rows`` maps each row kind the step adds to its :class:`RowKind` (a kind belongs to one step).
    ``gather(source, settings)``, when given, runs before the batch is built and fetches what the
    step needs from the exchange (through a :class:`~mutualrl.algorithms.context.StepSource`); the
    step finds it in ``ctx.gathered[name]``. ``serve(source, settings)``, when given, runs on every
    policy after all the step's rollouts and before the updates (a phase of the step) and returns
    the records it publishes for its peers and its metrics.
    A name can be registered once; a second registration raises ``ValueError``.
    """
    if not _NAME.match(name):
        raise ValueError(f"strategy name {name!r} must be lower-case letters, digits and '_', starting with a letter")
    bad = sorted((set(reads) | set(gathers)) - set(KINDS))
    if bad:
        raise ValueError(f"strategy {name!r} reads unknown record kinds {bad}; known: {list(KINDS)}")
    if gathers and gather is None:
        raise ValueError(f"strategy {name!r} declares gathers={sorted(gathers)} without a gather hook to fetch them")
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise ValueError(f"strategy {name!r}: settings must be a dataclass, got {settings!r}")
    rows = dict(rows or {})
    for kind, spec in rows.items():
        loss_term(spec.loss)  # KeyError naming the registered terms
        owner = _KIND_OWNER.get(kind)
        if owner is not None and owner != name:
            raise ValueError(f"strategy {name!r}: row kind {kind!r} is already declared by {owner!r}")

    def deco(fn: StrategyFn) -> StrategyFn:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered (by {_REGISTRY[name].apply.__module__}); "
                             "choose another name")
        _REGISTRY[name] = StrategyStep(name, fn, settings, rows, frozenset(reads), frozenset(needs),
                                       frozenset(provides), frozenset(breaks), frozenset(conflicts),
                                       description or _first_sentence(fn.__doc__), peer_rollouts, gather,
                                       serve, frozenset(gathers))
        for kind in rows:
            _KIND_OWNER[kind] = name
        return fn

    return deco


def unregister_strategy(name: str) -> None:
    """Remove a registered step (tests; a plugin being reloaded)."""
    step = _REGISTRY.pop(name, None)
    for kind in step.rows if step else ():
        _KIND_OWNER.pop(kind, None)


def _first_sentence(doc: str | None) -> str:
    """A docstring's first sentence on one line (a step's description when it gives none)."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def available_strategies() -> list[str]:
    """Names of every registered step."""
    return sorted(_REGISTRY)


def strategy_step(name: str) -> StrategyStep | None:
    """The registered step ``name``, or None."""
    return _REGISTRY.get(name)


def describe_strategies() -> str:
    """Every registered step with its one-line description (for ``--help`` and errors)."""
    return "; ".join(f"{n}: {_REGISTRY[n].description}" for n in available_strategies())


class StrategyError(ValueError):
    """A strategy name that does not parse; the message says why and what is valid."""


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy: the sharing steps after the base step, in the order they run."""

    steps: tuple[StrategyStep, ...]

    @property
    def name(self) -> str:
        return "+".join(s.name for s in self.steps) or BASE

    @property
    def reads(self) -> frozenset[str]:
        """Record kinds the steps read from peers, queried by the worker or gathered by a step
        (empty: the learner reads nothing)."""
        return frozenset().union(*(s.reads | s.gathers for s in self.steps))

    @property
    def queries(self) -> frozenset[str]:
        """Record kinds the worker queries for this step's prompts into ``ctx.peers`` (what a
        step's own ``gather`` hook fetches is not queried again)."""
        return frozenset().union(*(s.reads for s in self.steps))

    @property
    def shares(self) -> bool:
        return bool(self.steps)

    @property
    def serves(self) -> bool:
        """Some step works for its peers between the rollouts and the updates (a ``serve`` phase)."""
        return any(s.serve is not None for s in self.steps)

    @property
    def all_steps(self) -> tuple[StrategyStep, ...]:
        """The base step, then the sharing steps."""
        return (_REGISTRY[BASE], *self.steps)

    def settings(self, sharing: Any = None) -> dict[str, Any]:
        """Every step's settings, by step name, from a :class:`~mutualrl.config.SharingConfig` (its
        ``sharing.<step>`` blocks), a mapping of step name to a block or an instance, or None (the
        defaults)."""
        blocks = getattr(sharing, "steps", sharing) or {}
        return {s.name: s.settings_from(blocks.get(s.name)) for s in self.all_steps if s.settings is not None}

    def kinds(self, sharing: Any = None) -> dict[str, BoundKind]:
        """Every row kind of the chain, bound to its step's settings (``sharing`` as for :meth:`settings`)."""
        bound = self.settings(sharing)
        return {kind: BoundKind(kind, s.name, spec, bound.get(s.name))
                for s in self.all_steps for kind, spec in s.rows.items()}

    def peer_rollouts_per_prompt(self, sharing: Any = None) -> int:
        """Peer rollouts per prompt the chain trains on (their cost belongs in the learner's update)."""
        bound = self.settings(sharing)
        return sum(s.peer_rollouts(bound.get(s.name)) for s in self.steps if s.peer_rollouts)

    def optimizer_phases(self, sharing: Any = None) -> dict[str, float]:
        """The optimizer steps the chain adds after the policy's: phase name -> learning rate."""
        return {k.phase: k.learning_rate for k in self.kinds(sharing).values()  # type: ignore[misc]
                if k.phase != POLICY_PHASE}


def _order(steps: list[StrategyStep]) -> list[StrategyStep]:
    """``steps`` in an order where each finds what it needs: a step that provides a property runs
    before those that need it, one that breaks a property after those that need it; otherwise as
    given. Raises :class:`StrategyError` when no order exists or a need is never provided."""
    base = _REGISTRY[BASE]
    provided = set(base.provides).union(*(s.provides for s in steps))
    for s in steps:
        missing = sorted(s.needs - provided)
        if missing:
            givers = sorted(n for n, st in _REGISTRY.items() if set(missing) & st.provides)
            raise StrategyError(f"{s.name!r} needs {', '.join(missing)}, which no step of the chain provides"
                                + (f" (chain it with {' or '.join(map(repr, givers))})" if givers else ""))
    before: dict[int, set[int]] = {i: set() for i in range(len(steps))}
    for i, a in enumerate(steps):
        for j, b in enumerate(steps):
            if i != j and (a.provides & b.needs or a.needs & b.breaks):
                before[j].add(i)  # a runs before b
    out: list[int] = []
    while len(out) < len(steps):
        ready = [i for i in range(len(steps)) if i not in out and before[i] <= set(out)]
        if not ready:
            stuck = [steps[i].name for i in range(len(steps)) if i not in out]
            raise StrategyError(f"steps {', '.join(map(repr, stuck))} need what the others break: no order "
                                "lets each find what it needs")
        out.append(ready[0])
    return [steps[i] for i in out]


def parse_strategy(spec: str | Strategy) -> Strategy:
    """Parse ``independent`` or a chain of sharing steps such as ``xgrpo+sgt``, ordered so that each
    step finds what it needs.

    Raises :class:`StrategyError` for an unknown step (with the closest name), a step named twice,
    ``independent`` in a chain, two steps that provide an exclusive property (e.g. two that pool
    advantages), a declared conflict, or a chain no order of which gives each step what it needs.
    """
    if isinstance(spec, Strategy):
        return spec
    parts = [p.strip() for p in str(spec).split("+")]
    for p in parts:
        if p not in _REGISTRY:
            close = difflib.get_close_matches(p, list(_REGISTRY), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StrategyError(f"unknown strategy {p!r}{hint}; available: {', '.join(available_strategies())} "
                                "(combine with '+')")
    if len(set(parts)) != len(parts):
        raise StrategyError(f"strategy {spec!r} names a step twice")
    if BASE in parts:
        if len(parts) > 1:
            raise StrategyError(f"{BASE!r} cannot be combined with sharing steps")
        return Strategy(())
    steps = [_REGISTRY[p] for p in parts]
    for prop in sorted(EXCLUSIVE):
        givers = [s.name for s in steps if prop in s.provides]
        if len(givers) > 1:
            raise StrategyError(f"{' and '.join(map(repr, givers))} both provide {prop.replace('_', ' ')}; chain at "
                                "most one of them (e.g. with 'sgt')")
    for a in steps:
        for b in steps:
            if b.name in a.conflicts:
                raise StrategyError(f"{a.name!r} cannot be combined with {b.name!r}")
    return Strategy(tuple(_order(steps)))


def check_strategy_name(spec: str) -> str | None:
    """The error message of :func:`parse_strategy` for ``spec``, or None if it is valid."""
    try:
        parse_strategy(spec)
    except StrategyError as exc:
        return str(exc)
    return None
