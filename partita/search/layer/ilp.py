"""The strategy-selection problem as data, and swappable exact solvers for it.

``search/layer/intra_op.py`` builds a :class:`Problem` (costs already in seconds, memory in bytes) and
calls :func:`solve`; nothing here knows about graphs or meshes, so the solvers can be tested and
benchmarked (``bench/ilp_backends.py``) on synthetic problems. The formulation is written out in
``search/layer/intra_op.py``'s docstring.

Backends: ``"highs"``, ``"scip"``, ``"cbc"`` (OR-Tools pywraplp MIP), ``"cpsat"`` (OR-Tools CP-SAT
on costs rounded to nanoseconds), ``"dp"`` (exact dynamic programming when the edge graph is a
forest, e.g. a chain: Viterbi; with a memory budget it is exact only if its unconstrained optimum
fits, else it defers to the MIP) and ``"auto"`` (dp when it applies, else HiGHS — the fastest
proven-optimal MIP backend in ``bench/ilp_backends.py``).
Edge variables are continuous: with integral one-hot ``s`` the marginal constraints force them to
the product ``s_u x s_v``, so only the ``s`` are integer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from partita.errors import InfeasibleError, InternalError

BACKENDS = ("auto", "dp", "highs", "scip", "cbc", "cpsat")
_SCALE = 1e6  # seconds -> microseconds inside the solvers (their tolerances are absolute-ish)


@dataclasses.dataclass(frozen=True)
class Edge:
    u: int
    v: int
    costs: np.ndarray  # [num_strategies(u), num_strategies(v)]


@dataclasses.dataclass(frozen=True)
class Problem:
    node_costs: tuple[np.ndarray, ...]  # per vertex, cost of each strategy
    edges: tuple[Edge, ...]
    node_mems: tuple[np.ndarray, ...] | None = None  # per vertex, memory of each strategy
    mem_budget: float | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def objective(self, choice: Sequence[int]) -> float:
        c = sum(float(self.node_costs[v][k]) for v, k in enumerate(choice))
        return c + sum(float(e.costs[choice[e.u], choice[e.v]]) for e in self.edges)

    def memory(self, choice: Sequence[int]) -> float:
        if self.node_mems is None:
            return 0.0
        return sum(float(self.node_mems[v][k]) for v, k in enumerate(choice))

    def feasible(self, choice: Sequence[int]) -> bool:
        return self.mem_budget is None or self.memory(choice) <= self.mem_budget * (1 + 1e-9)


@dataclasses.dataclass(frozen=True)
class IlpStats:
    num_vars: int
    num_constraints: int
    status: str  # OPTIMAL | FEASIBLE (time limit, gap > 0)
    objective: float
    bound: float
    gap: float  # (objective - bound) / |objective|, from the solver's own numbers
    solve_time_s: float
    backend: str


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    stats: IlpStats


def normalize(p: Problem) -> Problem:
    """Sum parallel edges, orient them u < v, fold edges touching single-strategy vertices into costs."""
    costs = [np.asarray(c, dtype=float).copy() for c in p.node_costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for e in p.edges:
        m = np.asarray(e.costs, dtype=float)
        u, v = e.u, e.v
        if u > v:
            u, v, m = v, u, m.T
        if u == v:
            costs[u] += np.diag(m)
            continue
        merged[(u, v)] = merged[(u, v)] + m if (u, v) in merged else m.copy()
    edges = []
    for (u, v), m in sorted(merged.items()):
        if len(costs[u]) == 1:
            costs[v] += m[0]
        elif len(costs[v]) == 1:
            costs[u] += m[:, 0]
        else:
            edges.append(Edge(u, v, m))
    return Problem(tuple(costs), tuple(edges), p.node_mems, p.mem_budget)


def is_forest(p: Problem) -> bool:
    parent = list(range(p.num_nodes))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in p.edges:
        a, b = find(e.u), find(e.v)
        if a == b:
            return False
        parent[a] = b
    return True


def solve_dp(p: Problem) -> Solution | None:
    """Exact tree DP (Viterbi on chains) ignoring memory; None if the edge graph has a cycle."""
    t0 = time.perf_counter()
    p = normalize(p)
    if not is_forest(p):
        return None
    adj: dict[int, list[tuple[int, np.ndarray]]] = {v: [] for v in range(p.num_nodes)}
    for e in p.edges:
        adj[e.u].append((e.v, e.costs))
        adj[e.v].append((e.u, e.costs.T))
    choice = [-1] * p.num_nodes
    seen = [False] * p.num_nodes
    for root in range(p.num_nodes):
        if seen[root]:
            continue
        order: list[int] = []
        stack = [root]
        parent: dict[int, tuple[int, np.ndarray]] = {root: (-1, np.zeros((0, 0)))}
        seen[root] = True
        while stack:  # iterative DFS; children after parents in `order`
            x = stack.pop()
            order.append(x)
            for y, m in adj[x]:
                if not seen[y]:
                    seen[y] = True
                    parent[y] = (x, m)
                    stack.append(y)
        value = {x: np.asarray(p.node_costs[x], dtype=float).copy() for x in order}
        best_child: dict[int, np.ndarray] = {}
        for x in reversed(order):
            par, m = parent[x]
            if par < 0:
                continue
            tot = m + value[x][None, :]  # [strategies(par), strategies(x)]
            best_child[x] = np.argmin(tot, axis=1)
            value[par] += tot[np.arange(tot.shape[0]), best_child[x]]
        choice[root] = int(np.argmin(value[root]))
        for x in order[1:]:
            choice[x] = int(best_child[x][choice[parent[x][0]]])
    obj = p.objective(choice)
    stats = IlpStats(sum(len(c) for c in p.node_costs), 0, "OPTIMAL", obj, obj, 0.0, time.perf_counter() - t0, "dp")
    return Solution(tuple(choice), stats)


def solve(p: Problem, backend: str = "auto", time_limit_s: float = 60.0) -> Solution:
    """Minimum-cost feasible choice. Raises InfeasibleError when no choice fits the memory budget."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    _check_finite(p)
    if p.mem_budget is not None and p.node_mems is not None:
        least = sum(float(np.min(m)) for m in p.node_mems)
        if least > p.mem_budget * (1 + 1e-9):
            raise InfeasibleError(
                f"the layer needs at least {least / 2**30:.2f} GiB per device, the budget is "
                f"{p.mem_budget / 2**30:.2f} GiB.",
                "use more devices per stage (a larger mesh), ZeRO, recompute, or a smaller micro-batch.",
            )
    if backend in ("auto", "dp"):
        sol = solve_dp(p)
        if sol is not None and p.feasible(sol.choice):
            return sol
        if backend == "dp" and sol is None:
            raise ValueError("backend 'dp' needs a forest-shaped problem")
        backend = "highs"
    q = normalize(p)
    if backend == "cpsat":
        return _solve_cpsat(q, time_limit_s)
    return _solve_mip(q, backend, time_limit_s)


def _check_finite(p: Problem) -> None:
    """Every cost and memory a finite number: a NaN would make the exact DP's argmin (and a MIP's
    coefficients) meaningless, and no input can cause one; it is a bug in the cost model."""
    parts = [("cost", v, c) for v, c in enumerate(p.node_costs)]
    parts += [("edge cost", e.v, e.costs) for e in p.edges]
    parts += [("memory", v, m) for v, m in enumerate(p.node_mems or ())]
    for what, v, arr in parts:
        if not np.all(np.isfinite(arr)):
            raise InternalError(
                f"the layer ILP holds a {what} that is not a finite number (vertex {v}: {np.asarray(arr).tolist()[:6]}).",
                "this is a bug in Partita's cost model, not in the input: please report it with the command line.",
            )
    if p.mem_budget is not None and not np.isfinite(p.mem_budget):
        raise InternalError(f"the layer ILP's memory budget is {p.mem_budget}.", "please report it as a bug.")


def _no_solution(solver: str, status: str, infeasible: bool) -> Exception:
    """A solve without a solution: proven infeasible is the input's limit (:class:`InfeasibleError`,
    the search drops the option); any other status (abnormal, invalid model, unbounded, stopped by
    the time limit before a first solution) is not a statement about the input and must not read as
    "no plan fits" (:class:`InternalError`)."""
    if infeasible:
        return InfeasibleError(
            f"the {solver} solver found no feasible strategy choice (status {status}).",
            "raise the memory budget or use a larger mesh.",
        )
    return InternalError(
        f"the {solver} solver ended without a solution and without proving there is none (status {status}).",
        "this is a bug in Partita (or in the solver), not in the input: please report it with the command line.",
    )


@contextlib.contextmanager
def _quiet_fd1() -> Iterator[None]:
    """Silence C-level writes to stdout (file descriptor 1) for the duration."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no real fd 1 (captured stdout): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _solve_mip(p: Problem, backend: str, time_limit_s: float) -> Solution:
    from ortools.linear_solver import pywraplp

    t0 = time.perf_counter()
    with _quiet_fd1():  # HiGHS prints its banner on creation, before SuppressOutput can act
        solver = pywraplp.Solver.CreateSolver(backend.upper())
    if solver is None:
        raise RuntimeError(f"OR-Tools has no {backend} backend here")
    solver.SuppressOutput()
    solver.SetTimeLimit(int(time_limit_s * 1000))
    inf = solver.infinity()
    s = [[solver.BoolVar(f"s{v}_{k}") for k in range(len(c))] for v, c in enumerate(p.node_costs)]
    obj = solver.Objective()
    # rows are built with RowConstraint + SetCoefficient, not the natural API (``solver.Add(sum(..) == x)``),
    # whose Python expression walk cost about as much as HiGHS's solve (issue 35): the same rows, in the
    # same order, with the same coefficients
    for v, c in enumerate(p.node_costs):
        _row(solver, 1.0, [(x, 1.0) for x in s[v]])
        for k, x in enumerate(s[v]):
            obj.SetCoefficient(x, float(c[k]) * _SCALE)
    for n, e in enumerate(p.edges):
        nu, nv = e.costs.shape
        ev = [[solver.NumVar(0.0, 1.0, f"e{n}_{i}_{j}") for j in range(nv)] for i in range(nu)]
        costs = (e.costs * _SCALE).tolist()
        for i in range(nu):
            _row(solver, 0.0, [*((x, 1.0) for x in ev[i]), (s[e.u][i], -1.0)])
            for j in range(nv):
                obj.SetCoefficient(ev[i][j], costs[i][j])
        for j in range(nv):
            _row(solver, 0.0, [*((ev[i][j], 1.0) for i in range(nu)), (s[e.v][j], -1.0)])
    if p.mem_budget is not None and p.node_mems is not None:
        ct = solver.Constraint(-inf, 1.0)
        for v, m in enumerate(p.node_mems):
            for k, x in enumerate(s[v]):
                ct.SetCoefficient(x, float(m[k]) / p.mem_budget)
    obj.SetMinimization()
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, 1e-9)
    with _quiet_fd1():
        status = solver.Solve(params)
    dt = time.perf_counter() - t0
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        names = {getattr(pywraplp.Solver, n): n for n in ("INFEASIBLE", "UNBOUNDED", "ABNORMAL", "NOT_SOLVED")}
        names.update({getattr(pywraplp.Solver, "MODEL_INVALID", -99): "MODEL_INVALID"})
        raise _no_solution(backend, names.get(status, str(status)), status == pywraplp.Solver.INFEASIBLE)
    choice = tuple(int(np.argmax([x.solution_value() for x in sv])) for sv in s)
    objective = p.objective(choice)
    bound = min(objective, obj.BestBound() / _SCALE)
    name = "OPTIMAL" if status == pywraplp.Solver.OPTIMAL else "FEASIBLE"
    gap = max(0.0, (objective - bound) / abs(objective)) if objective else 0.0
    stats = IlpStats(solver.NumVariables(), solver.NumConstraints(), name, objective, bound, gap, dt, backend)
    return Solution(choice, stats)


def _row(solver: Any, rhs: float, terms: list[tuple[Any, float]]) -> None:
    """The row ``sum(c * x for x, c in terms) == rhs``."""
    ct = solver.RowConstraint(rhs, rhs, "")
    for x, c in terms:
        ct.SetCoefficient(x, c)


def _solve_cpsat(p: Problem, time_limit_s: float) -> Solution:
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    m = cp_model.CpModel()
    ns = 1e9  # integer nanoseconds
    s = [[m.new_bool_var(f"s{v}_{k}") for k in range(len(c))] for v, c in enumerate(p.node_costs)]
    terms = []
    for v, c in enumerate(p.node_costs):
        m.add_exactly_one(s[v])
        terms += [int(round(float(c[k]) * ns)) * x for k, x in enumerate(s[v])]
    for n, e in enumerate(p.edges):
        nu, nv = e.costs.shape
        ev = [[m.new_bool_var(f"e{n}_{i}_{j}") for j in range(nv)] for i in range(nu)]
        for i in range(nu):
            m.add(sum(ev[i]) == s[e.u][i])
        for j in range(nv):
            m.add(sum(ev[i][j] for i in range(nu)) == s[e.v][j])
        terms += [int(round(float(e.costs[i, j]) * ns)) * ev[i][j] for i in range(nu) for j in range(nv)]
    if p.mem_budget is not None and p.node_mems is not None:
        scale = 1e6 / p.mem_budget  # memory in millionths of the budget, rounded down (never over-admits)
        m.add(
            sum(int(np.ceil(float(mm[k]) * scale)) * x for mm, sv in zip(p.node_mems, s) for k, x in enumerate(sv))
            <= 1_000_000
        )
    m.minimize(sum(terms))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.linearization_level = 2
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    dt = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _no_solution("CP-SAT", solver.status_name(status), status == cp_model.INFEASIBLE)
    choice = tuple(int(np.argmax([solver.value(x) for x in sv])) for sv in s)
    objective = p.objective(choice)
    bound = min(objective, solver.best_objective_bound / ns)
    gap = max(0.0, (objective - bound) / abs(objective)) if objective else 0.0
    proto = m.proto
    stats = IlpStats(
        len(proto.variables), len(proto.constraints), solver.status_name(status), objective, bound, gap, dt, "cpsat"
    )
    return Solution(choice, stats)
