"""A bug is never disguised as bad input or as "no plan fits" (issue 34, item 2).

Before: ``search/layer/ilp.py`` raised ``InfeasibleError`` for every solver status but OPTIMAL and
FEASIBLE, and ``search/pipeline/stage_cost.py`` reads an ``InfeasibleError`` as "this option does not
fit": an abnormal solver end became "no plan fits in memory" (exit 2), a NaN cost went through the
exact DP's argmin into an exit-0 plan, and any other exception in a solve printed a traceback. Now
only a proven infeasibility is an ``InfeasibleError``; every other way a solve can end without a
solution, and any exception no check foresaw, is an internal error: one paragraph saying it is a bug
and how to report it, exit 70, the traceback only with ``--verbose``.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest

from partita.cli import main
from partita.errors import InfeasibleError, InternalError
from partita.search.layer import ilp


def _cycle_problem(budget: float | None = None) -> ilp.Problem:
    """Three vertices in a cycle (not a forest: the exact DP defers to the MIP)."""
    costs = tuple(np.array([1.0, 2.0]) for _ in range(3))
    edges = tuple(ilp.Edge(u, v, np.array([[0.0, 1.0], [1.0, 0.0]])) for u, v in ((0, 1), (1, 2), (0, 2)))
    mems = tuple(np.array([5.0, 1.0]) for _ in range(3)) if budget is not None else None
    return ilp.Problem(costs, edges, mems, budget)


def _status(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    from ortools.linear_solver import pywraplp

    monkeypatch.setattr(pywraplp.Solver, "Solve", lambda self, *a: getattr(pywraplp.Solver, name))


def test_only_a_proven_infeasibility_is_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ilp.solve(_cycle_problem(), backend="highs").choice == (0, 0, 0)
    _status(monkeypatch, "INFEASIBLE")
    with pytest.raises(InfeasibleError):
        ilp.solve(_cycle_problem(), backend="highs")
    for name in ("ABNORMAL", "NOT_SOLVED", "UNBOUNDED"):
        _status(monkeypatch, name)
        with pytest.raises(InternalError, match=f"status {name}"):
            ilp.solve(_cycle_problem(), backend="highs")


def test_a_cost_that_is_not_a_number_is_a_bug() -> None:
    p = _cycle_problem()
    bad = ilp.Problem((np.array([np.nan, 1.0]), *p.node_costs[1:]), p.edges)
    with pytest.raises(InternalError, match="not a finite number"):
        ilp.solve(bad)  # the exact DP would have picked an arbitrary strategy
    with pytest.raises(InternalError):
        ilp.solve(dataclasses_replace(p, node_mems=(np.array([np.inf, 1.0]),) * 3, mem_budget=10.0))


def dataclasses_replace(p: ilp.Problem, **kw: object) -> ilp.Problem:
    import dataclasses

    return dataclasses.replace(p, **kw)  # type: ignore[arg-type]


_ARGV = ["compile", "mlp", "--cluster", "4xCPU", "--global-batch", "8", "--seq", "4", "--dtype", "f32", "--force"]


def _compile(tmp_path: Path, *extra: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main([*_ARGV, *extra, "--out", str(tmp_path / "out")])
    return rc, " ".join(err.getvalue().split()) if "Traceback" not in err.getvalue() else err.getvalue()


@pytest.fixture
def serial(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PARTITA_WORKERS", "1")  # the patched solver runs in this process
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))


def test_an_abnormal_solver_end_is_an_internal_error_not_no_plan_fits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, serial: None
) -> None:
    monkeypatch.setattr(ilp, "solve_dp", lambda p: None)  # every layer through the MIP
    _status(monkeypatch, "ABNORMAL")
    rc, err = _compile(tmp_path)
    assert rc == 70, err
    assert err.startswith("partita: internal error: the highs solver ended without a solution"), err
    assert "This is a bug in Partita" in err and "--verbose" in err
    assert "no plan fits" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_unforeseen_exception_in_a_solve_is_one_paragraph(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, serial: None
) -> None:
    def broken(*a: object, **k: object) -> None:
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(ilp, "solve", broken)
    rc, err = _compile(tmp_path)
    assert rc == 70 and "Traceback" not in err, err
    assert err.startswith("partita: internal error: ZeroDivisionError: float division by zero (at partita/"), err
    assert "no plan fits" not in err
    rc, err = _compile(tmp_path, "--verbose")  # the traceback, for the bug report
    assert rc == 70 and "Traceback" in err and "ZeroDivisionError" in err, err
