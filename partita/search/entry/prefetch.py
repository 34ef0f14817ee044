"""Work beside the search in forked worker processes: the layer ILPs it is about to read, and side tasks.

Called by ``search/planner.plan_graph`` before the outer loop (issue 20): the unit tables of every
pure device type, tp and micro-batch the configurations read (``Search.table``), then those of the
mixed classes' replica shares (``Search.mixes``). Each solve is ``SolverCosts.layer`` as the serial
search runs it; the workers send back what it cached (the ``LayerCost`` / ``LayerSolution`` pair and
the memo's entry) and the parent stores it as if it had solved it, so the search reads the same floats
and the plan is byte-identical (``tests/search/test_prefetch.py``, statistics included: the solves are
grouped so that the memo hits a worker sees are those the serial order sees).

Workers fork (the graph and the cost models are inherited, nothing is re-traced) and ignore Ctrl-C:
the parent's ``KeyboardInterrupt`` ends the pool. They run without the cyclic collector (they end with
their pool). Where ``fork`` is not available, one CPU is, fewer
than :data:`MIN_SOLVES` solves are left, JAX is imported, or ``PARTITA_WORKERS=1``, the same solves run here, one after
another: which tables are solved never depends on the machine, so neither do the plan's statistics.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

MIN_SOLVES = 96  # below this, starting workers costs about what it saves (a solve is ~6 ms, a fork ~0.1 s)
MAX_WORKERS = 4

_COSTS: Any = None  # the parent's SolverCosts, inherited by the forked workers


def workers() -> int:
    """Worker processes to use: ``PARTITA_WORKERS`` where set (1 = serial), else the CPUs this
    process may run on, at most :data:`MAX_WORKERS` (1 once JAX is imported)."""
    env = os.environ.get("PARTITA_WORKERS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    if "jax" in sys.modules:  # JAX's threads make a fork unsafe (it warns of deadlocks): one process
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def prefetch(costs: Any, wanted: Sequence[tuple[int, Any, int, int]]) -> int:
    """Solve ``costs.layer(index, device, tp, micro_batch)`` for each of ``wanted`` that is not cached
    yet: in worker processes where it pays, else here (module docstring); returns how many."""
    groups: dict[tuple, list[tuple[int, str, int, int]]] = {}
    seen = set()
    for index, dev, tp, b in wanted:
        key = costs._key(index, dev, tp, b)
        if key in costs._cache or key in seen:
            continue
        seen.add(key)
        # one memo entry serves every layer of a kind (the first layer too, where its boundary is the
        # same): such solves stay in one worker, in the serial order, so its hits are the serial ones
        groups.setdefault((key[0], key[2], key[3], key[4]), []).append((index, dev.name, tp, b))
    n = min(workers(), len(groups))
    if n < 2 or len(seen) < MIN_SOLVES or "fork" not in mp.get_all_start_methods():
        devices = {d.name: d for d in costs.cluster.device_types()}
        for group in groups.values():  # the same solves, here, in the same order within each group
            for index, name, tp, b in group:
                costs.layer(index, devices[name], tp, b)
        return len(seen)
    jobs = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    global _COSTS
    _COSTS = costs
    try:
        with mp.get_context("fork").Pool(n, initializer=_worker_init) as pool:
            results = pool.map(_solve_group, jobs, chunksize=1)
    finally:
        _COSTS = None
    by_name = {lay.name: lay for lay in costs.graph.layers}
    for cached, solved_for, memo_entries, counts in results:
        costs._cache.update(cached)
        costs._solved_for.update(solved_for)
        for k, layer_name, sol in memo_entries:
            costs.memo._store.setdefault(k, (costs.graph, by_name[layer_name], sol))
        costs.num_solves += counts[0]
        costs.solve_time_s += counts[1]
        costs.memo.hits += counts[2]
        costs.memo.misses += counts[3]
    return len(seen)


def _worker_init() -> None:
    """A worker ignores Ctrl-C (the parent ends the pool), dies at once on SIGTERM, and runs without the
    cyclic collector: it ends with its pool, and the cycles it makes are freed then (as
    ``gc_freeze.throwaway`` does for the trace child; measured: 0.03-0.08 CPU s of collections per
    worker on the Qwen2-72B-shape compile).

    SIGTERM is what ``Pool.terminate`` sends. A Python handler inherited from the command (``cli``'s,
    which ends a worker with ``os._exit``) runs only between bytecodes: a worker that takes the signal
    just before it blocks on the pool's task-queue lock (``sem_wait``, after the last check for
    signals) never runs it, and the parent waits for that worker forever. Seen once, on a loaded
    machine (load average 6): the compile hung in ``Pool.terminate``'s join, one worker asleep in
    ``SemLock.acquire`` with no signal pending. The default action ends the process in the kernel."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    gc.disable()


def _solve_group(group: list[tuple[int, str, int, int]]) -> tuple[dict, dict, list, tuple]:
    """In a worker: the group's solves, and what they added to the (inherited) caches."""
    costs = _COSTS
    devices = {d.name: d for d in costs.cluster.device_types()}
    before_cache, before_memo = set(costs._cache), set(costs.memo._store)
    n0, t0, h0, m0 = costs.num_solves, costs.solve_time_s, costs.memo.hits, costs.memo.misses
    for index, name, tp, b in group:
        costs.layer(index, devices[name], tp, b)
    cached = {k: v for k, v in costs._cache.items() if k not in before_cache}
    solved_for = {k: costs._solved_for[k] for k in cached}
    memo_entries = [(k, v[1].name, v[2]) for k, v in costs.memo._store.items() if k not in before_memo]
    counts = (
        costs.num_solves - n0,
        costs.solve_time_s - t0,
        costs.memo.hits - h0,
        costs.memo.misses - m0,
    )
    return cached, solved_for, memo_entries, counts


_TASK: Any = None  # the background task, inherited by its forked worker


def in_background(task: Any, worth: bool = True) -> Any:
    """``task()`` in one forked worker while the caller goes on (where :func:`workers` allows two or
    more and ``fork`` is available); returns a function that waits for its result. Elsewhere the
    function runs ``task()`` itself, when called: the same result either way (the task must read
    only what exists when this is called, as the fork copies it then, and return picklable data);
    its ``cancel()`` ends the worker where the result is not wanted. ``worth``: False where the task is
    too small to pay for a fork (the caller's judgement: ``plan_graph``'s, from how many layer ILPs
    the search has).
    ``plan_graph`` runs the compile report's yardstick and the graph's hash this way beside its
    search (issue 20): the search runs in one process, the machine has more CPUs than that."""
    if not worth or workers() < 2 or "fork" not in mp.get_all_start_methods():
        return _Here(task)
    global _TASK
    _TASK = task
    try:
        pool = mp.get_context("fork").Pool(1, initializer=_worker_init)
    finally:
        _TASK = None
    return _There(pool, pool.apply_async(_run_task))


class _Here:
    def __init__(self, task: Any) -> None:
        self.task = task

    def __call__(self) -> Any:
        return self.task()

    def cancel(self) -> None:
        pass


class _There:
    def __init__(self, pool: Any, pending: Any) -> None:
        self.pool, self.pending = pool, pending

    def __call__(self) -> Any:
        try:
            return self.pending.get()
        finally:
            self.cancel()

    def cancel(self) -> None:  # also on Ctrl-C or an error in the caller: the worker ignores Ctrl-C
        self.pool.terminate()


def _run_task() -> Any:
    return _TASK()
