"""TRL-style custom reward functions, loaded by import path and called defensively.

A reward function has the signature ``f(prompts, completions, **columns) -> list[float]``
(the columns are ``answer``, ``question``, ``source``, ``prompt_id``). A call that raises, hangs
past the timeout or returns a non-finite value gives reward 0 for the affected completions and
is counted; the run goes on.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., list[float]]


_IN_PROCESS: dict[str, RewardFn] = {}
IN_PROCESS_PREFIX = "in-process:"


def reward_function_path(fn: RewardFn) -> str | None:
    """``module:qualname`` of a function that another process can import, else None (a lambda, a
    closure, a function of the ``__main__`` script)."""
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qual:
        return None
    try:
        return f"{module}:{qual}" if load_reward_function(f"{module}:{qual}") is fn else None
    except ValueError:
        return None


def register_in_process(fn: RewardFn) -> str:
    """A name for ``fn`` that :func:`load_reward_function` resolves in this process only (what the
    Python API uses for a reward function no other process can import)."""
    key = f"{IN_PROCESS_PREFIX}{getattr(fn, '__qualname__', 'fn')}@{id(fn):x}"
    _IN_PROCESS[key] = fn
    return key


def load_reward_function(path: str) -> RewardFn:
    """Import ``package.module:function`` (or ``package.module.function``), or find a function
    registered with :func:`register_in_process`."""
    if path.startswith(IN_PROCESS_PREFIX):
        fn_in = _IN_PROCESS.get(path)
        if fn_in is None:
            raise ValueError(f"reward function {path!r} lives in another process: pass an importable function "
                             "(module:function) to run policies in worker processes")
        return fn_in
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {mod_name!r} for reward function {path!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"module {mod_name!r} has no callable {attr!r}")  # noqa: TRY004 (a config error)
    return fn


def call_reward_function(fn: RewardFn, prompts: list[str], completions: list[str],
                         columns: dict[str, list[Any]], timeout_s: float, stats: Any) -> list[float]:
    """Call ``fn`` in a daemon thread with a timeout; sanitise the result to finite floats."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(prompts, completions, **columns)
        except BaseException as exc:  # noqa: BLE001 - any failure of user code is a zero reward
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="mutualrl-reward-fn")
    thread.start()
    thread.join(timeout_s)
    n = len(completions)
    if thread.is_alive():
        stats.timed_out += n
        return [0.0] * n
    if "error" in box:
        stats.raised += n
        return [0.0] * n
    value = box.get("value")
    try:
        values = [float(v) if v is not None else math.nan for v in value]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        stats.raised += n
        return [0.0] * n
    if len(values) != n:
        stats.raised += n
        return [0.0] * n
    out = []
    for v in values:
        if math.isfinite(v):
            out.append(v)
        else:
            stats.non_finite += 1
            out.append(0.0)
    return out
