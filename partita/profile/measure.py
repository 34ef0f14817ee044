"""Timing and fitting primitives shared by the profiler's benches (``profile/``).

``measure`` times a callable the way every micro-benchmark of ``partita profile`` does;
``nnls_fit`` is the non-negative least-squares fit the profiler and the step probes use. Kept apart
from ``profiler.py`` so the benches (``collectives_bench.py``, ``step_probe.py``) import it without
importing the profiler that drives them (no import circle).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any


# ---- timing -------------------------------------------------------------------------------
def measure(fn: Callable[[], Any], sync: Callable[[], None], max_s: float, min_sample_s: float = 2e-3) -> dict:
    """Median seconds per call of ``fn``: calls are batched so one sample lasts >= ``min_sample_s``."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(10_000, int(min_sample_s / first)))
    reps = max(1, min(15, int(max_s / (first * inner))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    samples.sort()
    return {"median_s": samples[len(samples) // 2], "min_s": samples[0], "max_s": samples[-1], "reps": reps}


def nnls_fit(rows: Sequence[Sequence[float]], t: Sequence[float]) -> tuple[list[float], float]:
    """Non-negative least squares of ``t ~ rows @ x`` weighted by ``1/t`` (relative error).

    Few unknowns, so every support subset is tried. Returns ``(x, relative RMS error)``."""
    import itertools

    import numpy as np

    a = np.asarray(rows, dtype=float)
    y = np.asarray(t, dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    aw, yw = a * w[:, None], y * w
    best: tuple[float, np.ndarray] = (math.inf, np.zeros(a.shape[1]))
    for r in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(aw[:, cols], yw, rcond=None)
            if (x < 0).any():
                continue
            full = np.zeros(a.shape[1])
            full[list(cols)] = x
            err = float(np.sqrt(np.mean((aw @ full - yw) ** 2)))
            if err < best[0] - 1e-12:
                best = (err, full)
    return [float(v) for v in best[1]], best[0]
