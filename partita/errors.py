"""Error types. Every error a user can cause says what is wrong and how to fix it.

The CLI catches :class:`PartitaError`, prints ``str(err)`` as one paragraph and exits with
``err.exit_code`` (2 for bad input and infeasible requests). Any other exception is a bug: the
CLI prints it as an :class:`InternalError` paragraph (exit 70) with a bug-report hint, and the
traceback with ``--verbose``.
"""

from __future__ import annotations


class PartitaError(Exception):
    """Base class: ``problem`` names what is wrong, ``fix`` says what would be right."""

    exit_code = 2

    def __init__(self, problem: str, fix: str = "", detail: str = "") -> None:
        self.problem = problem.strip()
        self.fix = fix.strip()
        self.detail = detail  # the user's own traceback (a factory's, a data function's): shown with --verbose
        super().__init__(self.problem + (f" Fix: {self.fix}" if self.fix else ""))


class ModelError(PartitaError):
    """The model could not be found, built or traced (unknown zoo name, data-dependent control flow)."""


class ClusterSpecError(PartitaError):
    """A cluster spec (shorthand, YAML or JSON file) is malformed or names an unknown device type."""


class IRError(PartitaError):
    """The IR verifier found an inconsistent graph; the message names the node."""

    exit_code = 1


class PlanError(PartitaError):
    """A plan file is corrupt, from another Partita version, or does not match the launch."""


class ConfigError(PartitaError):
    """A training configuration value is out of range (batch not divisible, unknown dtype...)."""


class InfeasibleError(PartitaError):
    """No plan fits: the message says how much memory the best plan needed against what exists."""


class RunError(PartitaError, RuntimeError):
    """The launched training program failed (a rank raised or was killed); the message holds its last
    lines. Exit code 1: the input was fine, the run was not."""

    exit_code = 1


class InternalError(PartitaError):
    """A bug in Partita, not a problem with the input (a solver that ends in an abnormal state, a cost
    that is not a number, an exception no check foresaw). Never disguised as bad input or as "no plan
    fits": the CLI prints it as an internal error with a bug-report hint, exit code 70 (EX_SOFTWARE)."""

    exit_code = 70
