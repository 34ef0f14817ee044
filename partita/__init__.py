"""Partita: an auto-parallelization compiler for training on homogeneous and mixed GPU clusters.

The package root is the public entry point: ``partita.parallelize`` / ``partita.step``
(``api.py``, top of the flow). The flow itself, top to bottom, is the folder list: ``frontends/``
-> ``passes/`` -> ``search/`` -> ``plan.py`` -> ``backends/torch|jax`` (see README, Architecture).

``parallelize`` and ``step`` are loaded on first use (PEP 562): the ``partita`` command imports this
package before its ``main`` can take over Ctrl-C, so the package itself imports nothing heavy.
"""

from typing import Any

from partita.version import __version__

__all__ = ["__version__", "parallelize", "step"]


def __getattr__(name: str) -> Any:
    if name in ("parallelize", "step"):
        from partita import api

        return getattr(api, name)
    raise AttributeError(f"module 'partita' has no attribute {name!r}")
