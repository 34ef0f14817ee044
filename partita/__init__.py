"""Partita: an auto-parallelization compiler for training on homogeneous and mixed GPU clusters."""

__version__ = "0.1.0"
