"""The declared schema of Partita's environment variables, checked by ``cli.py`` before any work.

Each ``PARTITA_*`` variable a user may set is read deep inside one module (``search/entry/prefetch``,
``backends/torch/rehearse``, ``cluster``...), where a value it does not understand used to be ignored
in silence (``PARTITA_WORKERS=many`` ran as if unset, ``PARTITA_CALIBRATION=maybe`` as "on"). Here each
one is declared with the values it takes; an empty value counts as unset. Variables the runtime sets
for its own processes (``PARTITA_NODE_INDEX``, ``PARTITA_RESULT``, the fault-injection ones) are not
the user's and are not listed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from partita.errors import ConfigError

SWITCH = ("on", "off", "1", "0", "true", "false", "yes", "no", "none")

# name -> (least, most) for integers, or the tuple of words it takes; and what it does (for the message)
ENVIRONMENT: dict[str, tuple[tuple[int, int] | tuple[str, ...], str]] = {
    "PARTITA_WORKERS": ((1, 1024), "worker processes of the search (1: none)"),
    "PARTITA_REHEARSE_JOBS": ((1, 1024), "rehearsal processes run at once"),
    "PARTITA_MAX_RESTARTS": ((0, 1000), "torchrun restarts after a rank fails"),
    "PARTITA_CALIBRATION": (SWITCH, "the shipped calibration profiles"),
    "PARTITA_STORED_TRACES": (SWITCH, "the stored traces of the large zoo models"),
}


FLAGS = {"PARTITA_MAX_RESTARTS": "--max-restarts"}  # the option that sets the same thing for one command


def check_environment(env: Mapping[str, str] | None = None) -> ConfigError | None:
    """The first declared variable whose value is not one it takes, as a refusal; None when all are fine."""
    env = os.environ if env is None else env
    for name, (allowed, what) in ENVIRONMENT.items():
        raw = env.get(name, "")
        value = raw.strip()
        if not value:
            continue
        if isinstance(allowed[0], int):
            least, most = allowed  # type: ignore[misc]
            if value.isascii() and value.isdigit() and least <= int(value) <= most:
                continue
            flag = FLAGS.get(name)
            return ConfigError(
                f"{name}={raw!r} ({what}) is not an integer from {least} to {most}.",
                f"set {name} to an integer from {least} to {most}, or unset it for the default"
                + (f" (or pass {flag} N instead)." if flag else "."),
            )
        if value.lower() not in allowed:
            return ConfigError(
                f"{name}={raw!r} ({what}) is not one of {', '.join(allowed)}.",
                f"set {name} to on or off, or unset it for the default.",
            )
    return None
