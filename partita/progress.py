"""Progress lines of a command that can take long: one short line per phase, on stderr.

Beside ``driver.py`` and ``cli.py`` (which call it); nothing below them prints. Shown, as pip and
torchrun show theirs, only when stderr is a terminal, so a log file, a pipe or a test's captured
output gets none; ``PARTITA_PROGRESS=1`` turns them on anywhere (a CI log), ``PARTITA_PROGRESS=0``
off. They go to stderr, so ``--json`` output on stdout stays one JSON document either way; with
``--json`` and a terminal they are off unless asked for.
"""

from __future__ import annotations

import os
import sys

_ON = ("1", "on", "yes", "true")
_OFF = ("0", "off", "no", "false")


def wanted(json_out: bool = False) -> bool:
    """Whether this command prints progress lines (module docstring)."""
    env = os.environ.get("PARTITA_PROGRESS", "").strip().lower()
    if env in _ON:
        return True
    if env in _OFF:
        return False
    return not json_out and sys.stderr.isatty()


def say(msg: str) -> None:
    """One progress line: ``partita: <msg>`` on stderr, flushed."""
    print(f"partita: {msg}", file=sys.stderr, flush=True)
