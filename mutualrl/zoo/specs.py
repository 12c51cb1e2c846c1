"""What a zoo policy is: architecture, tokenizer, warm-start mixture and the skill band it must land in."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mutualrl.errors import UserError

ZOO_VERSION = "8"
"""Bump when anything that changes a built policy changes (code, task, tokenizers). 8: a phase that
stalls nudges its mixture and learning rate, starts over from another initialisation, then stops
(:mod:`mutualrl.zoo.stall`); a build that never stalls for ``stall_patience`` checks is the one 7 built."""

KEYED_WHEN_SET: tuple[str, ...] = ("stall_checks", "stall_min_gain", "stall_patience", "stall_restarts",
                                   "generalist_lr", "generalist_catch_up")
"""Spec fields added after the shipped policies were built: they enter a cache key only when set away
from their default, so the default specs keep the key they were shipped under."""

ARCHS: tuple[str, ...] = ("gpt2", "llama", "gpt_neox", "qwen2")
"""Architecture families a :class:`ZooSpec` can name (``transformers`` model types). The default
policies use 32-dimensional attention heads, a size vLLM's CPU kernels support, so they can also
sample through ``generation.engine: vllm``."""


@dataclass(frozen=True)
class ZooSpec:
    """How to build one zoo policy.

    ``sft_mixture`` maps task types (source names of the zoo task) to their share of the warm-start
    examples; ``bands`` maps every type to the greedy accuracy band ``(low, high)`` the policy must
    land in, measured every ``sft_eval_every`` steps on a validation slice of the training problems
    (never the test split). SFT stops as soon as every type is inside its band (``band_margin``
    inside its edges), and a build that has not got there after ``sft_max_steps`` fails (it never
    hands out a policy outside its band). ``n_inner`` of 0 means
    4 × ``n_embd``; ``n_kv_head`` of 0 means ``n_head`` (Llama/Qwen2 only). ``vocab_size`` is an
    upper bound for the tokenizer trainer (the card records the real size).
    """

    name: str
    arch: str
    tokenizer: str
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    sft_mixture: dict[str, float]
    bands: dict[str, tuple[float, float]]
    sft_max_steps: int = 4000
    lr: float = 3e-3
    batch: int = 96
    n_inner: int = 0
    n_kv_head: int = 0
    warmup_steps: int = 50
    weight_decay: float = 0.01
    max_positions: int = 128
    sft_eval_every: int = 25
    band_margin: float = 0.15
    """SFT stops once every validation accuracy is this share of its band's width inside it (30-50 %:
    33-47 %); the card records the band itself. The margin absorbs validation noise and the luck of
    the stopping step (a tiny model's accuracy swings by points from check to check)."""
    generalist_target: float = 0.0
    """First train every type evenly until each reaches this validation accuracy, then specialise
    on ``sft_mixture`` (the other types fade into their bands: latent skills, as in a fine-tune of
    a generalist, which come back from far fewer examples than skills never learned). 0: no
    generalist phase."""
    generalist_max_steps: int = 6000
    """Cap of the generalist phase (a build that does not get there fails)."""
    generalist_lr: float = 0.0
    """Learning rate of the generalist phase (0: ``lr``); the specialisation runs at a third of ``lr``
    either way. A rate that suits the specialisation can be one the generalist phase does not learn
    at from every initialisation: GPT-2's at 3e-3 stayed under 12 % addition for 4,000 steps at build
    seed 1, and reached 77 % by step 2,200 at 1e-3 (docs/zoo.md)."""
    generalist_catch_up: float = 1.0
    """In the generalist phase, the weight in the mixture of a skill at or above ``generalist_target``
    at the last check, relative to one still below it (1: an even mixture throughout). A skill often
    reaches the target hundreds of steps before another (its sudden onset comes first); below 1 the
    lagging skills get most of each batch until they catch up, and a skill that falls back under the
    target gets its even share again. The default policies use :data:`CATCH_UP`."""
    stall_checks: int = 60
    """Checks of a phase in which a skill outside its goal came no ``stall_min_gain`` closer to it
    (its best distance so far) that make a stall: the build restarts or stops (exit 2) instead of
    running to its cap (:mod:`mutualrl.zoo.stall`; 0: never). 60 checks are 1,500 generalist steps
    (checked every ``sft_eval_every``) or 600 specialising ones (every 10): the shipped builds went up
    to 43 checks without such progress before their sudden onset."""
    stall_min_gain: float = 0.01
    """How much closer to its goal (accuracy, 0.01 = one point) a skill must come to make progress."""
    stall_patience: int = 20
    """Checks without progress after which a skill is nudged (its share, and while specialising the
    learning rate; 0: never), again after as many more."""
    stall_restarts: int = 1
    """Times a stalled build starts over from another initialisation (:func:`~mutualrl.zoo.stall.init_seed`)
    before it stops."""
    description: str = ""

    @property
    def generalist_rate(self) -> float:
        """The generalist phase's learning rate: ``generalist_lr``, or ``lr`` where that is 0."""
        return self.generalist_lr or self.lr

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the spec."""
        d = dataclasses.asdict(self)
        d["bands"] = {k: list(v) for k, v in self.bands.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ZooSpec:
        """The spec :meth:`to_dict` gave ``d`` for (bands back to tuples)."""
        return cls(**{**d, "bands": {k: (float(v[0]), float(v[1])) for k, v in d["bands"].items()},
                      "sft_mixture": {k: float(v) for k, v in d["sft_mixture"].items()}})

    def cache_key(self, seed: int, task_key: str = "", version: str = ZOO_VERSION) -> str:
        """Hash of (spec, seed, task, ``version``: :data:`ZOO_VERSION` unless a shipped build's is
        asked for) naming the cache folder; the fields of :data:`KEYED_WHEN_SET` count only when set."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        spec = {k: v for k, v in self.to_dict().items() if k not in KEYED_WHEN_SET or v != defaults[k]}
        payload = json.dumps({"spec": spec, "seed": seed, "version": version, "task": task_key}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def check(self, types: Sequence[str]) -> None:
        """Raise :class:`UserError` unless mixture and bands name exactly the task's types, sensibly."""
        where = f"zoo policy {self.name!r}"
        unknown = sorted((set(self.sft_mixture) | set(self.bands)) - set(types))
        if unknown:
            raise UserError(f"{where}: unknown task type(s) {unknown} in sft_mixture/bands; valid: {sorted(types)}")
        if set(self.bands) != set(types):
            raise UserError(f"{where}: bands must give a (low, high) range for every task type {sorted(types)}")
        if not any(w > 0 for w in self.sft_mixture.values()):
            raise UserError(f"{where}: sft_mixture needs a positive weight")
        for k, (lo, hi) in self.bands.items():
            if not 0.0 <= lo < hi <= 1.0:
                raise UserError(f"{where}: band of {k!r} must satisfy 0 <= low < high <= 1, got ({lo}, {hi})")
            if lo > 0 and self.sft_mixture.get(k, 0) <= 0 and not self.generalist_target > 0:
                raise UserError(f"{where}: {k!r} must reach {lo:.0%} but has no weight in sft_mixture")
        if not self.generalist_lr >= 0:
            raise UserError(f"{where}: generalist_lr must be >= 0 (0: lr), got {self.generalist_lr}")
        if not 0 < self.generalist_catch_up <= 1:
            raise UserError(f"{where}: generalist_catch_up must be in (0, 1] (1: an even mixture throughout), "
                            f"got {self.generalist_catch_up}")
        if min(self.stall_checks, self.stall_patience, self.stall_restarts) < 0 or not 0 <= self.stall_min_gain < 1:
            raise UserError(f"{where}: stall_checks, stall_patience and stall_restarts must be >= 0 and "
                            f"stall_min_gain in [0, 1), got {self.stall_checks}, {self.stall_patience}, "
                            f"{self.stall_restarts}, {self.stall_min_gain}")


def rate_levers(spec: ZooSpec) -> str:
    """The learning-rate flags of ``zoo build`` with ``spec``'s values, for an error's list of levers."""
    return f"--lr, now {spec.lr:g}; --generalist-lr for the generalist phase, now {spec.generalist_rate:g}"


OWN_BAND = (0.35, 1.0)
"""Greedy accuracy band of a policy's own skill: specialising lifts it as far as it goes."""
WEAK_BAND = (0.0, 0.05)
"""Greedy accuracy band of a skill a policy learned as a generalist and then lost while specialising
(what its peer can give back): too rare for its own GRPO groups to find, still latent in its weights."""
GENERALIST_TARGET = 0.30
"""Validation accuracy every skill reaches in the generalist phase, before the specialisation."""
CATCH_UP = 0.25
"""The default policies' ``generalist_catch_up``: a skill that has reached the generalist target
trains on a fifth of each batch (two skills) while the other catches up. ZOO_VERSION 8's builds of
seeds 1-5 spent 475-1,200 generalist steps with one skill at the target waiting for the other."""

ZOO: dict[str, ZooSpec] = {
    "gpt2-add": ZooSpec(
        name="gpt2-add", arch="gpt2", tokenizer="byte_bpe", vocab_size=384,
        n_layer=3, n_embd=160, n_head=5, sft_mixture={"add": 1.0},
        bands={"add": OWN_BAND, "sub": WEAK_BAND}, generalist_target=GENERALIST_TARGET, generalist_lr=1e-3,
        generalist_catch_up=CATCH_UP, description="GPT-2 family, byte-level BPE; a generalist specialised in addition, subtraction lost",
    ),
    "llama-sub": ZooSpec(
        name="llama-sub", arch="llama", tokenizer="unigram", vocab_size=400,
        n_layer=3, n_embd=128, n_head=4, n_kv_head=2, n_inner=384,
        sft_mixture={"sub": 1.0}, bands={"add": WEAK_BAND, "sub": OWN_BAND}, generalist_target=GENERALIST_TARGET,
        generalist_catch_up=CATCH_UP, description="Llama family (GQA, RoPE, SwiGLU), SentencePiece-style Unigram; a generalist specialised "
                    "in subtraction, addition lost",
    ),
    "neox-mix": ZooSpec(
        name="neox-mix", arch="gpt_neox", tokenizer="char", vocab_size=128,
        n_layer=3, n_embd=128, n_head=4, sft_mixture={"add": 0.5, "sub": 0.5},
        bands={"add": (0.10, 0.30), "sub": (0.10, 0.30)},
        description="GPT-NeoX family (parallel residual, partial rotary), character level; "
                    "a weak generalist",
    ),
}
"""The default zoo policies, by name."""

DEFAULT_NAMES: tuple[str, ...] = ("gpt2-add", "llama-sub")
"""The policies built when no names are given (the demo's two learners)."""


def check_names(names: Sequence[str], table: dict[str, ZooSpec] | None = None) -> None:
    """Raise :class:`UserError` naming the unknown zoo policies among ``names``."""
    table = ZOO if table is None else table
    unknown = [n for n in names if n not in table]
    if unknown:
        raise UserError(f"unknown zoo polic{'y' if len(unknown) == 1 else 'ies'} "
                        f"{', '.join(map(repr, unknown))}; valid: {', '.join(table)}")
