"""Partita: an auto-parallelization compiler for training on homogeneous and mixed GPU clusters.

The package root is the public entry point: ``partita.parallelize`` / ``partita.step``
(``api.py``, top of the flow). The flow itself, top to bottom, is the folder list: ``frontends/``
-> ``passes/`` -> ``search/`` -> ``plan.py`` -> ``backends/torch|jax`` (see README, Architecture).
"""

from partita.api import parallelize, step
from partita.version import __version__

__all__ = ["__version__", "parallelize", "step"]
