"""``planner.Option.pick_at`` / ``best`` (issue 20: a faster first-least-combo search) against numpy's
``argmin`` / ``take_along_axis`` they replaced, on random stacks with ties, infinities and NaNs."""

from __future__ import annotations

import numpy as np
import pytest

from partita.search.entry.planner import Option


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("combos", [1, 2, 3, 12])
def test_pick_and_best_equal_argmin(seed: int, combos: int) -> None:
    rng = np.random.default_rng(seed)
    stack = rng.integers(0, 4, (combos, 5, 6, 4)).astype(float)  # small ints: many ties
    stack[rng.random(stack.shape) < 0.4] = np.inf
    stack[:, 0, 0, :] = np.inf  # a slice where nothing fits
    if seed % 3 == 2:
        stack[rng.integers(combos), 1, 2, 3] = np.nan  # argmin picks a NaN: so must the fast path
    opt = Option(0, 1, 1, (), (), [], [(0, "none")] * combos, stack)
    want = stack.argmin(axis=0)
    assert np.array_equal(opt.best, np.take_along_axis(stack, want[None], axis=0)[0], equal_nan=True)
    every = [opt.pick_at(k, j, s) for k in range(5) for j in range(6) for s in range(4)]
    assert every == want.ravel().tolist()  # one entry at a time, as the uncapped DP reads them
