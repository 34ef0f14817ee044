"""Partita: an auto-parallelization compiler for training on homogeneous and mixed GPU clusters."""

__version__ = "0.1.0"

from partita.api import parallelize, step  # noqa: E402  (needs __version__ first: driver imports it)

__all__ = ["__version__", "parallelize", "step"]
