"""Exchange URLs: the one parser of ``sqlite:///path``, ``memory://[name]`` and ``ray://name``.

A run config's ``exchange`` may also be the shorthand ``sqlite`` (a file in the run directory).
:meth:`ExchangeURL.for_run` resolves it for one process, :meth:`ExchangeURL.shared_by_processes`
for workers in several processes (a bare ``memory://`` store cannot be shared between them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from mutualrl.errors import UserError

SCHEMES = ("sqlite", "memory", "ray")
EXAMPLES = "sqlite:///runs/see.db, sqlite:////abs/see.db, memory://, ray://see"
RUN_DB = "exchange.db"
"""The file name of a run's own SQLite exchange (``exchange: sqlite``)."""


@dataclass(frozen=True)
class ExchangeURL:
    """A parsed exchange URL: ``scheme``, ``where`` (file path, store name or actor name) and options."""

    scheme: str
    where: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_str(cls, url: str) -> ExchangeURL:
        """Parse ``url``; raises :class:`UserError` (naming the URL and the valid forms) if malformed."""
        if not isinstance(url, str):
            raise UserError(f"exchange URL must be a string, got {type(url).__name__}")
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise UserError(f"exchange URL {url!r} has no scheme; use one of: {EXAMPLES}")
        scheme = scheme.lower()
        if scheme not in SCHEMES:
            raise UserError(f"unknown exchange scheme {scheme!r} in {url!r}; use one of: {EXAMPLES}")
        where, _, query = rest.partition("?")
        try:
            opts = tuple(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
        except ValueError as exc:
            raise UserError(f"exchange URL {url!r} has a malformed query string: {exc}") from exc
        if scheme == "sqlite":
            if not where.startswith("/") or where == "/":
                raise UserError(f"exchange URL {url!r} needs a file path: sqlite:///relative.db or "
                                "sqlite:////absolute/path.db")
            where = where[1:]
        elif scheme == "ray" and (not where or "/" in where):
            raise UserError(f"exchange URL {url!r} needs a plain actor name, e.g. ray://see")
        return cls(scheme, where, opts)

    @classmethod
    def for_run(cls, spec: str, run_dir: str | Path | None) -> ExchangeURL:
        """A run config's ``exchange`` for one process: ``sqlite`` is ``<run_dir>/exchange.db`` (an
        in-memory store without a run directory); anything else is parsed as a URL."""
        if spec == "sqlite":
            if run_dir is None:
                return cls("memory", "")
            return cls("sqlite", str((Path(run_dir) / RUN_DB).resolve()))
        return cls.from_str(spec)

    def shared_by_processes(self, run_dir: str | Path | None, scratch: str | Path) -> ExchangeURL:
        """This URL as every worker process can open it: a ``memory://`` store becomes a SQLite file
        in the run directory (or ``scratch`` without one)."""
        if self.scheme != "memory":
            return self
        base = Path(run_dir) if run_dir is not None else Path(scratch)
        return ExchangeURL("sqlite", str((base / RUN_DB).resolve()))

    @property
    def option_dict(self) -> dict[str, str]:
        return dict(self.options)

    def side_files(self) -> list[Path]:
        """The files a SQLite exchange keeps (database, WAL, shared memory); none for other schemes."""
        if self.scheme != "sqlite":
            return []
        db = Path(self.where)
        return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]

    def __str__(self) -> str:
        where = "/" + self.where if self.scheme == "sqlite" else self.where
        query = f"?{urlencode(self.options)}" if self.options else ""
        return f"{self.scheme}://{where}{query}"
