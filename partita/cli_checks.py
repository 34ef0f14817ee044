"""What the ``partita`` command checks before any work, and how it ends on a bug (beside ``cli.py``).

:data:`LIMITS`: the bounds of every numeric option; :func:`_check_arguments`: those bounds, no empty
strings, the declared ``PARTITA_*`` variables (``env_check.py``), all refused before any work starts;
:func:`_internal_error`: an exception that is not the input's fault (an :class:`~partita.errors.InternalError`,
or one no check foresaw) as one paragraph with a bug-report hint, exit 70, the traceback with ``--verbose``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from partita.errors import ConfigError, InternalError, PartitaError

# The bounds of every numeric option, checked before any work starts (issue 34): (least, most).
# The upper bounds are far above any real job (a million devices, a 4M-token sequence) and far below
# what would make the search or the runtime allocate without end.
LIMITS: dict[str, tuple[int, int]] = {
    "global_batch": (1, 1 << 24),
    "seq": (1, 1 << 22),
    "batch": (1, 1 << 16),
    "steps": (1, 10_000_000),
    "tp": (1, 1024),
    "cp": (1, 1024),
    "pp": (1, 4096),
    "dp": (1, 1 << 20),
    "micro_batch": (1, 1 << 24),
    "gpus_per_node": (1, 1024),
    "nproc": (1, 1024),
    "virtual_stages": (1, 64),
    "nnodes": (1, 1 << 16),
    "checkpoint_every": (0, 10_000_000),
    "max_restarts": (0, 1000),
}
TIME_BUDGET_S = (1.0, 7 * 24 * 3600.0)  # `partita profile --time-budget`, seconds


def _paragraph(text: str) -> str:
    """One paragraph of 100 columns with no breaks inside names such as A100-80G or a path."""
    return textwrap.fill(text, 100, break_on_hyphens=False, break_long_words=False)


_POSITIONAL = {"model": "MODEL", "dir": "DIR", "dirs": "DIR"}


def _check_arguments(args: argparse.Namespace) -> PartitaError | None:
    """The numeric options against :data:`LIMITS`, and no empty strings: refused before any work."""
    for name, (least, most) in LIMITS.items():
        v = getattr(args, name, None)
        flag = f"--{name.replace('_', '-')}"
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, int) and not least <= x <= most:
                kind = "a positive" if least else "a non-negative"
                return ConfigError(
                    f"{flag} is {x}; it must be {kind} integer of at most {most:,}.",
                    f"pass {flag} N with N >= {least} and N <= {most}.",
                )
    from partita.env_check import check_environment

    bad_env = check_environment()
    if bad_env is not None:
        return bad_env
    budget = getattr(args, "time_budget", None)
    if isinstance(budget, float) and not TIME_BUDGET_S[0] <= budget <= TIME_BUDGET_S[1]:  # nan fails too
        return ConfigError(
            f"--time-budget is {budget}; it must be a number of seconds from {TIME_BUDGET_S[0]:g} to "
            f"{TIME_BUDGET_S[1]:g}.",
            "pass --time-budget S with a finite, positive S (e.g. 240).",
        )
    for name, v in vars(args).items():
        if name == "extra":
            continue
        values = v if isinstance(v, list) else [v]
        if any(isinstance(x, str) and not x.strip() for x in values):
            flag = _POSITIONAL.get(name, f"--{name.replace('_', '-')}")
            return ConfigError(f"{flag} is an empty string.", f"give {flag} a value, or leave it out for its default.")
    return None


def _internal_error(err: Exception, verbose: bool) -> int:
    """A bug in Partita (an :class:`InternalError`, or an exception no check foresaw): one paragraph that
    says it is not the input's fault and how to report it, exit 70 (EX_SOFTWARE); ``--verbose`` prints the
    traceback first. Never "no plan fits" or a bad-input paragraph, and never a bare traceback."""
    import traceback

    if verbose:
        traceback.print_exception(type(err), err, err.__traceback__)
    if isinstance(err, InternalError):
        what = err.problem
    else:
        frames = traceback.extract_tb(err.__traceback__)
        ours = [f for f in frames if "partita" in f.filename.replace("\\", "/").split("/")]
        at = ours[-1] if ours else (frames[-1] if frames else None)
        where = f" (at {_short_path(at.filename)}:{at.lineno})" if at is not None else ""
        what = f"{type(err).__name__}: {str(err).rstrip('.')}{where}."
    text = (
        f"{what} This is a bug in Partita, not a problem with your input. Please report it with the command "
        "line and the output of the same command with --verbose (which prints the traceback)."
    )
    print("partita: internal error: " + _paragraph(text), file=sys.stderr)
    return InternalError.exit_code


def _short_path(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    if "partita" not in parts:
        return parts[-1]
    return "/".join(parts[len(parts) - 1 - parts[::-1].index("partita") :])
