"""The ``mutualrl`` command line.

Each subcommand lives next to the code it drives and exposes ``register(subparsers)``; this file
only wires them together and turns :class:`~mutualrl.errors.UserError` into exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mutualrl.allocation.base import WorkerFailed
from mutualrl.errors import UserError
from mutualrl.run.checkpoint import CheckpointError

# (module, attribute) pairs; each attribute is ``register(subparsers) -> None``.
_COMMANDS: list[tuple[str, str]] = [
    ("mutualrl.commands", "register"),
    ("mutualrl.study.command", "register"),
    ("mutualrl.export.model", "register"),
    ("mutualrl.thl.cli", "register"),
    ("mutualrl.realmodels", "register"),
    ("mutualrl.allocation.cli", "register"),
    ("mutualrl.zoo", "register"),
]


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser (all subcommands)."""
    parser = argparse.ArgumentParser(
        prog="mutualrl",
        description="Mutual Reinforcement Learning: train several heterogeneous LM policies at once "
        "with GRPO while they share experience (SEE + THL + PRP/XGRPO/SGT).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, attr in _COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a subcommand module not built yet
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            continue
        getattr(module, attr)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Returns the process exit code (0 ok, 2 bad input, 1 failure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except UserError as exc:
        print(f"mutualrl: error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:  # e.g. a full disk: the message names the last good checkpoint
        print(f"mutualrl: error: {exc}", file=sys.stderr)
        return 1
    except WorkerFailed as exc:  # names the worker, the last good checkpoint and the resume command
        print(f"mutualrl: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mutualrl: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
