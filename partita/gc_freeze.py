"""The cyclic garbage collector kept off a compile's long-lived heap (issue 35 item 10: cold compile time).

Part of the driver's compile (``driver.plan_handle``, ``cli``'s compile). A cold compile of a
``config.json`` imports torch and transformers, builds the model on the meta device and traces it:
about half a million objects that live until the process ends. CPython's collector rescans all of
them at every full (generation 2) collection: six while the imports run, more during the trace and
the search, and one more as the interpreter exits, ~1.4 of the ~20 CPU seconds of a cold compile of
the Qwen2-72B-shape ``config.json``; and a forked search worker (``search/entry/prefetch.py``) that
collects writes to every one of their pages, so the fork copies them. Here the collector is off
while modules are imported and the model is built (they make almost no garbage cycles), and what
exists is frozen (``gc.freeze()``: a generation the collector never scans) before the trace and
again after it (the trace's garbage collected first, so nothing unreachable is pinned). Nothing
computed changes: the collector only frees unreachable cycles, and the ones made after a freeze are
still freed.

A process forked for one task that ends with it runs with the collector off: ``trace_child.py``'s
trace (:func:`throwaway`) and the search's workers (``search/entry/prefetch.py``, which may not import
this module, does the same). The cycles it makes are freed when it exits, moments later. Measured on
the Qwen2-72B-shape compile: ~300 young collections, 0.15 CPU seconds, in the trace child and
0.03-0.08 s in each search worker, all on the critical path; the peak memory of the trace and of the
search is the same with the collector off (436 vs 438 MiB, 253 MiB): they make almost no cycles.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_OPEN = [False]  # a frozen_heap of this process is open (an inner one does nothing)


@contextlib.contextmanager
def frozen_heap(*, process_ends: bool = False) -> Iterator[None]:
    """The collector off until :func:`settle`; what was frozen is unfrozen on exit, so a user's
    process (``partita.parallelize``) is left as it was, unless ``process_ends`` (the ``partita``
    command: then the interpreter's last collection skips it too). Does nothing inside another one,
    where the collector is off, or where the process froze objects itself (its choice)."""
    own = not _OPEN[0] and gc.isenabled() and gc.get_freeze_count() == 0
    if own:
        _OPEN[0] = True
        gc.disable()
    try:
        yield
    finally:
        if own:
            _OPEN[0] = False
            gc.enable()
            if not process_ends:
                gc.unfreeze()


def settle(*, collect: bool = True) -> None:
    """Inside a :func:`frozen_heap`: collect the garbage cycles made so far (``collect``; not after
    imports, which make almost none), freeze what is left and turn the collector on, so that it scans
    only the objects made from here on. Elsewhere nothing."""
    if _OPEN[0]:
        if collect:
            gc.collect()
        gc.freeze()
        gc.enable()


def throwaway() -> None:
    """In a forked process that ends with its one task: the collector off for the rest of its life
    (module docstring). Never call it in a process that lives on (the compiling process, a user's)."""
    gc.disable()
