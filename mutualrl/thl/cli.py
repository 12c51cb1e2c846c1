"""``mutualrl thl report``: the THL residual of a tokenizer pair, as a table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mutualrl.errors import UserError
from mutualrl.thl.align import align_batch
from mutualrl.thl.residual import pair_report
from mutualrl.thl.vocabs import resolve

__all__ = ["DEFAULT_TEXTS", "cmd_report", "register"]

#: Texts used when ``--texts`` is not given: reasoning-style arithmetic plus a little Unicode.
DEFAULT_TEXTS: tuple[str, ...] = (
    "Calculate 415 * 336 - 590. First, 415 * 336 = 139440. Then 139440 - 590 = 138850. Answer: 138850",
    "State the final answer: 57 + 87 + 70 = 214",
    "Let's think step by step.\n\n1) 12 / 4 = 3\n2) 3 + -7 = -4\n\nThe answer is -4.",
    "  Über-café naïve ﬁnance: 3½ × 2 = 7 🙂",
    "价格是 42 元。\tTotal:\u00a0100%",
)


def _tokenizer(spec: str) -> Any:
    try:
        return resolve(spec)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None


def _read_texts(path: str | None) -> list[str]:
    if path is None:
        return list(DEFAULT_TEXTS)
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--texts: no such file: {path}")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--texts: {path} is not UTF-8 text") from None
    if p.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise UserError(f"--texts: {path}:{n} is not valid JSON") from None
            text = obj.get("text") if isinstance(obj, dict) else obj
            if not isinstance(text, str):
                raise UserError(f"--texts: {path}:{n} has no string 'text' field")
            texts.append(text)
    else:
        texts = [line for line in raw.splitlines() if line]
    if not texts:
        raise UserError(f"--texts: {path} holds no text")
    return texts


def cmd_report(args: argparse.Namespace) -> int:
    """Print the residual report of ``--source`` vs ``--target`` over the texts."""
    from rich.console import Console
    from rich.table import Table

    texts = _read_texts(args.texts)
    src, tgt = _tokenizer(args.source), _tokenizer(args.target)
    rep = pair_report(align_batch(texts, src, tgt))
    table = Table(title=f"THL residual: {args.source} -> {args.target} ({rep.texts} texts, {rep.chars} chars)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("round-trip failure rate (either side)", f"{rep.roundtrip_fail_rate:.3f}"),
        ("  source round-trip failure rate", f"{rep.source_roundtrip_fail_rate:.3f}"),
        ("  target round-trip failure rate", f"{rep.target_roundtrip_fail_rate:.3f}"),
        ("chars in non-1:1 chunks", f"{rep.non_1to1_char_frac:.3f}"),
        ("mean tokens per chunk", f"{rep.mean_chunk_tokens:.3f}"),
        ("max tokens per chunk", str(rep.max_chunk_tokens)),
        ("chars source cannot represent", f"{rep.source_lost_char_frac:.4f}"),
        ("chars target cannot represent", f"{rep.target_lost_char_frac:.4f}"),
        ("inexact chunks", f"{rep.inexact_chunk_frac:.4f}"),
        ("chunks with no token on one side", str(rep.unprojectable_chunks)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    return 0


def register(subparsers: Any) -> None:
    """Add ``thl report`` to the ``mutualrl`` command line."""
    thl = subparsers.add_parser("thl", help="Tokenizer Heterogeneity Layer tools")
    thl_sub = thl.add_subparsers(dest="thl_command", metavar="SUBCOMMAND")

    def _help(args: argparse.Namespace) -> int:
        thl.print_help()
        return 2

    thl.set_defaults(func=_help)
    rep = thl_sub.add_parser(
        "report",
        help="residual of aligning two tokenizers (round trips, non-1:1 text, chunk sizes)",
        description="TOK is one of cl100k, minilm, smollm2, gemma3, a tokenizer.json file or a "
        "directory holding one.",
    )
    rep.add_argument("--source", required=True, metavar="TOK", help="source tokenizer")
    rep.add_argument("--target", required=True, metavar="TOK", help="target tokenizer")
    rep.add_argument(
        "--texts", metavar="FILE", default=None,
        help="texts to measure: one per line, or .jsonl with a 'text' field (default: built-in samples)",
    )
    rep.set_defaults(func=cmd_report)
