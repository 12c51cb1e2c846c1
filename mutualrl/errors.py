"""User-facing errors. Anything raised as :class:`UserError` exits the CLI with code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, CLI flag, path). The CLI prints it and exits with code 2."""


class ConfigError(UserError):
    """A config field is invalid. ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"config error at '{field}': {message}")
