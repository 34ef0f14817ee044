"""Resharding between two layouts of one tensor on an N-d mesh, as a list of per-axis collectives.

Used by ``search/layer/intra_op.py`` to price the edge between a producer's output layout and a
consumer's required input layout (and, in backward, the gradient flowing the other way).

A *layout* is one DTensor-style placement string per mesh axis: ``"R"`` (replicate), ``"S(d)"``
(shard tensor dim d), ``"P"`` (partial sum). Per axis, ``src -> dst``:

=============  ==============================  ==================================================
src -> dst     collective                      S (bytes in the cost formula)
=============  ==============================  ==================================================
R -> S, R -> P local slice / zero (free)       -
S -> P         local zero-pad (free)           -
S(d) -> R      all_gather                      per-device *output* (gathered) bytes
P -> S(d)      reduce_scatter                  per-device *input* bytes
P -> R         all_reduce                      per-device buffer bytes
S(d) -> S(e)   all_to_all                      per-device buffer bytes
=============  ==============================  ==================================================

"Per-device" means divided by the sharding on the *other* axes at that moment. Steps run in an
order that keeps buffers small: free slices first, then reduce-scatters / all-to-alls /
all-reduces (axis order), then all-gathers (slowest link first, while the tensor is still
sharded on the faster axes).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from partita.search.pricing.cost_model import CostModel
from partita.search.pricing.mesh import LogicalMesh

Layout = tuple[str, ...]
_SHARD = re.compile(r"^S\((\d+)\)$")


def shard_dim(p: str) -> int | None:
    """Tensor dim of a ``"S(d)"`` placement, None for R / P."""
    m = _SHARD.match(p)
    return int(m.group(1)) if m else None


def replicated(ndim: int) -> Layout:
    return ("R",) * ndim


def shard_factor(layout: Sequence[str], mesh: LogicalMesh, skip: int | None = None) -> int:
    """How many pieces the tensor is cut into per device (product of sizes of sharding axes)."""
    return math.prod(s for i, (p, s) in enumerate(zip(layout, mesh.shape)) if i != skip and p.startswith("S"))


@dataclasses.dataclass(frozen=True)
class ReshardStep:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    axis: int
    bytes: float  # S of the cost formula (see the table above)


def reshard_steps(src: Sequence[str], dst: Sequence[str], full_bytes: float, mesh: LogicalMesh) -> list[ReshardStep]:
    """The collectives that turn layout ``src`` into ``dst`` for a tensor of ``full_bytes`` bytes."""
    state = list(src)
    steps: list[ReshardStep] = []
    # 1. free local transitions shrink the tensor before anything moves
    for i, (a, b) in enumerate(zip(src, dst)):
        if a != b and (a == "R" or b == "P"):
            state[i] = b
    # 2. reductions and all-to-alls
    for i, b in enumerate(dst):
        a = state[i]
        if a == b:
            continue
        if a == "P" and b != "R":
            steps.append(ReshardStep("reduce_scatter", i, full_bytes / shard_factor(state, mesh, skip=i)))
        elif a == "P":
            steps.append(ReshardStep("all_reduce", i, full_bytes / shard_factor(state, mesh, skip=i)))
        elif b != "R":
            steps.append(ReshardStep("all_to_all", i, full_bytes / shard_factor(state, mesh)))
        else:
            continue  # S -> R: gather last
        state[i] = b
    # 3. all-gathers, slowest link first
    gathers = [i for i, b in enumerate(dst) if state[i] != b]
    gathers.sort(key=lambda i: (mesh.link(i).bandwidth, i))
    for i in gathers:
        steps.append(ReshardStep("all_gather", i, full_bytes / shard_factor(state, mesh, skip=i)))
        state[i] = dst[i]
    return steps


def reshard_cost(
    src: Sequence[str], dst: Sequence[str], full_bytes: float, mesh: LogicalMesh, cost_model: CostModel
) -> float:
    """Seconds to reshard (sum of the steps' alpha-beta times; steps on one tensor do not overlap)."""
    if tuple(src) == tuple(dst):
        return 0.0
    return sum(
        cost_model.collective_time(s.kind, s.bytes, mesh.link(s.axis))
        for s in reshard_steps(src, dst, full_bytes, mesh)
    )


def grad_requirement(out_layout: Sequence[str]) -> Layout:
    """Layout the gradient of a tensor must have for its producer's backward: a partial-sum output's
    gradient is the full (replicated) gradient; R and S(d) keep their placement."""
    return tuple("R" if p == "P" else p for p in out_layout)
