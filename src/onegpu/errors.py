"""User-facing errors: one message that names the field/file/line, and how to fix it."""

from __future__ import annotations


class OnegpuError(Exception):
    """An error caused by the user's input or environment. The CLI prints it without a traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.hint}" if self.hint else self.message


class ConfigError(OnegpuError):
    """A bad configuration value or key."""


class DataError(OnegpuError):
    """Missing, empty or malformed training data."""


class ModelError(OnegpuError):
    """A model or tokenizer that cannot be loaded."""


class UnavailableError(OnegpuError):
    """A requested method needs a library or hardware that is not here."""
