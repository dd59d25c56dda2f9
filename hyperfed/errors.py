"""The one base class of user-facing errors (the bottom layer: it imports nothing of hyperfed).

Every error a user can cause with a config, a data file, a run directory or a command-line
option derives from :class:`HyperfedError`; its message is one line that says what is wrong
and how to fix it. The command line catches this class in one place (the command group of
``hyperfed.cli``, around every command), prints ``error: <message>`` and exits with code 2,
before any work or after leaving the run directory as it was.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HyperfedError(Exception):
    """A one-line, user-facing error (bad config, data, run directory or option)."""


class ConfigError(HyperfedError, ValueError):
    """A configuration value that is wrong: names the key and what is allowed."""


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """``"did you mean fedavg? "`` for the ``choices`` close to a mistyped ``word`` (difflib's
    ratio >= 0.6), or ``""`` when none is: the hint in front of a one-line error's list of
    allowed values."""
    close = difflib.get_close_matches(word, list(choices), n=n)
    return f"did you mean {' or '.join(close)}? " if close else ""
