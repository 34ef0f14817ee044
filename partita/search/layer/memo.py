"""Memo of intra-op solutions, so repeated layers and the inter-op search's many queries are cheap.

The inter-op search (``search/pipeline/inter_op.py``) asks for the same (layer kind, device type, submesh,
micro-batch) many times, and a 96-block model has one block kind: only the first query of a key
builds and solves an ILP. The key is (layer kind, device type name, mesh shape, axis names, env
items, dtype, optimizer, memory-budget bucket, boundary, cost-model fingerprint). Budgets are
bucketed down to a multiple of ``budget_bucket_bytes`` and the ILP is solved with the bucket's
floor, so a cached answer never exceeds the budget it is served for. A hit for a different layer of
the same kind is renamed by position (nodes, then parameters), since layers of one kind are
identical up to renaming.
"""

from __future__ import annotations

import dataclasses
import math

from partita.ir import Graph, Layer, Node
from partita.plan import Collective
from partita.search.layer.intra_op import LayerSolution, solve_layer
from partita.search.pricing.cost_model import CostModel
from partita.search.pricing.mesh import LogicalMesh

_Key = tuple


class IntraOpMemo:
    def __init__(self, budget_bucket_bytes: float = 2**28) -> None:
        self.budget_bucket_bytes = budget_bucket_bytes
        self.hits = 0
        self.misses = 0
        self._store: dict[_Key, tuple[Graph, Layer, LayerSolution]] = {}

    def copy(self) -> IntraOpMemo:
        """A memo that starts with this one's solutions and counts its own hits and misses (what it
        adds stays in it): ``hand_best.yardstick`` prices beside the search without moving its counts."""
        out = IntraOpMemo(self.budget_bucket_bytes)
        out._store = dict(self._store)
        return out

    def __len__(self) -> int:
        return len(self._store)

    def __bool__(self) -> bool:  # an empty memo is still a memo (``memo or IntraOpMemo()`` keeps it)
        return True

    def key(
        self,
        layer: Layer,
        mesh: LogicalMesh,
        env: dict[str, int],
        dtype: str,
        optimizer: str,
        cost_model: CostModel,
        budget: float,
        boundary: tuple[str, ...] | None,
        tp_style: str = "auto",
    ) -> _Key:
        bucket = math.floor(budget / self.budget_bucket_bytes)
        bnd = tuple(boundary) if boundary is not None else mesh.default_boundary()
        return (
            layer.kind,
            mesh.device.name,
            mesh.shape,
            mesh.axis_names,
            mesh.gpus_per_node,
            tuple(sorted(env.items())),
            dtype,
            optimizer,
            bucket,
            bnd,
            cost_model.fingerprint(),
            tp_style,
        )

    def solve(
        self,
        graph: Graph,
        layer: Layer,
        mesh: LogicalMesh,
        *,
        env: dict[str, int],
        dtype: str,
        optimizer: str = "adam",
        cost_model: CostModel,
        memory_budget: float | None = None,
        boundary: tuple[str, ...] | None = None,
        tp_style: str = "auto",
    ) -> LayerSolution:
        """:func:`~partita.search.layer.intra_op.solve_layer` with memoisation (same signature)."""
        budget = float(mesh.device.memory_bytes if memory_budget is None else memory_budget)
        k = self.key(layer, mesh, env, dtype, optimizer, cost_model, budget, boundary, tp_style)
        if k in self._store:
            self.hits += 1
            g0, l0, sol = self._store[k]
            return sol if l0.name == layer.name and g0 is graph else rename_solution(sol, g0, l0, graph, layer)
        self.misses += 1
        floor = math.floor(budget / self.budget_bucket_bytes) * self.budget_bucket_bytes
        sol = solve_layer(
            graph,
            layer,
            mesh,
            env=env,
            dtype=dtype,
            optimizer=optimizer,
            cost_model=cost_model,
            memory_budget=floor if floor > 0 else budget,
            boundary=boundary,
            tp_style=tp_style,
        )
        self._store[k] = (graph, layer, sol)
        return sol


_NODE_INDEX: dict[int, tuple[list[Node], dict[str, Node]]] = {}


def _nodes_by_name(g: Graph) -> dict[str, Node]:
    """``{name: node}`` of ``g``, built once per node list (``Graph.node`` scans the list: renaming
    every layer of a 96-block model through it was quadratic)."""
    hit = _NODE_INDEX.get(id(g))
    if hit is None or hit[0] is not g.nodes:
        if len(_NODE_INDEX) > 16:
            _NODE_INDEX.clear()
        hit = (g.nodes, {n.name: n for n in g.nodes})
        _NODE_INDEX[id(g)] = hit
    return hit[1]


def rename_solution(sol: LayerSolution, g0: Graph, src: Layer, g1: Graph, dst: Layer) -> LayerSolution:
    names = dict(zip(src.nodes, dst.nodes))
    n0, n1 = _nodes_by_name(g0), _nodes_by_name(g1)
    for a, b in zip(src.nodes, dst.nodes):  # tensors by position of the nodes that produce them
        names.update(zip(n0[a].outputs, n1[b].outputs))
        names.update(zip(n0[a].inputs, n1[b].inputs))
    fqn = {g0.tensors[a].fqn or a: g1.tensors[b].fqn or b for a, b in zip(src.params, dst.params)}
    names.update(fqn)
    for a, b in fqn.items():  # module paths and their parents (tp_plan, column-parallel reasons)
        for _ in range(2):
            a, b = a.rpartition(".")[0], b.rpartition(".")[0]
            if a and b:
                names.setdefault(a, b)

    def words(s: str) -> str:
        return " ".join(names.get(w, w) for w in s.split(" "))

    return dataclasses.replace(
        sol,
        op_strategies={names[k]: v for k, v in sol.op_strategies.items()},
        param_placements={fqn.get(k, k): v for k, v in sol.param_placements.items()},
        collectives=tuple(dataclasses.replace(c, reason=words(c.reason)) for c in sol.collectives),
        tp_plan={names.get(k, k): v for k, v in sol.tp_plan.items()},
    )


def collectives_total(colls: tuple[Collective, ...], phase: str | None = None) -> float:
    """Bytes moved by ``colls`` (S x count), optionally of one phase."""
    return sum(c.bytes * c.count for c in colls if phase is None or c.phase == phase)
