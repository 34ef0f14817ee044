"""Collective counting: what a training step really communicated, next to the plan's own records.

Used by ``backends/torch/train.py`` around each counted step (:class:`CollectiveCounter`) and by
``backends/torch/rehearse.py`` (:func:`collective_event`, :func:`op_bytes`), so a run and its
rehearsal count alike. There is no runtime-side prediction: the program carries the Plan's
``Stage.collectives`` (``search/program/records.py``, complete per step with bytes) folded to ``kind@axis``
as ``PROGRAM["predicted_collectives"]``, and :func:`compare` checks a counted step against them:
the same kinds and mesh axes, equal counts, total bytes within :data:`BYTES_TOL`.

Measured: :class:`CollectiveCounter` is a ``TorchDispatchMode`` (through ``frontends/torch_shim.py``;
``CommDebugMode`` cannot be used: it counts no send/recv, and FACTS.md records it crashing in
FSDP2 hooks) recording every op of the ``c10d`` (eager ``dist.*``, FSDP2, pipelining) and
``_c10d_functional`` (DTensor) namespaces: kind, process group and bytes of the full tensor
(all-gather output, reduce-scatter input). On an op with DTensor arguments it steps aside
(``NotImplemented``) so that DTensor runs first and the mode then sees the collectives DTensor's
redistributions issue; without that, the mode would see the DTensor op and none of its communication.
:meth:`CollectiveCounter.summary` names each group by its mesh axis (``dp``, ``tp``, ``pp``, ``tied``,
``world``: the caller's map from group names) and every send or receive ``p2p@pp``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from partita.frontends import torch_shim
from partita.frontends.torch_shim import TorchDispatchMode

BYTES_TOL = 0.02  # a counted step's bytes per kind@axis may differ from the plan's by this fraction

KINDS = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "p2p",
    "recv_": "p2p",
    "recv_any_source_": "p2p",
}
_NOT_COMM = ""
_KIND_OF: dict[Any, str] = {}  # OpOverload -> kind ("" for every other op): one dict lookup per op


def _kind(func: Any) -> str:
    kind = _KIND_OF.get(func)
    if kind is None:
        ns = func.namespace
        kind = KINDS.get(_opname(func), _NOT_COMM) if ns in ("c10d", "_c10d_functional") else _NOT_COMM
        _KIND_OF[func] = kind
    return kind


def _opname(func: Any) -> str:
    return str(func.overloadpacket.__name__)  # "allreduce_" for c10d.allreduce_.default


def tensor_bytes(t: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors; 0 for anything else."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return 0


def collective_event(func: Any, args: Sequence[Any]) -> tuple[str, str | None, int] | None:
    """(kind, process group name, bytes) when ``func`` is a collective or p2p op, else None."""
    kind = _KIND_OF.get(func)
    if kind is None:
        kind = _kind(func)
    if not kind:
        return None
    op = _opname(func)
    if func.namespace == "_c10d_functional":  # the group name is the last argument, a string
        group = torch_shim.group_name(args[-1]) if args else None
    else:  # the process group is a ScriptObject argument
        names = (torch_shim.group_name(a) for a in args if isinstance(a, torch.ScriptObject))
        group = next((n for n in names if n is not None), None)
    return kind, group, op_bytes(op, args)


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()`` then ``c.summary(axes)`` -> {kind@axis: {count, bytes}}."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self.events: list[tuple[str, str | None, int]] = []

    def __enter__(self) -> CollectiveCounter:
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if DTensor in types:
            return NotImplemented  # let DTensor run; its collectives come back through this mode
        kind = _KIND_OF.get(func)
        if kind is None or kind:
            ev = collective_event(func, args)
            if ev is not None:
                self.events.append(ev)
        return func(*args, **(kwargs or {}))

    def summary(self, axes: Mapping[str, str] | None = None) -> dict[str, dict[str, int]]:
        """Per ``kind@axis`` (``axes``: group name -> axis name; a group not in it is ``group:NAME``;
        send and receive are ``p2p@pp``) the count and total bytes of the step."""
        return summarize(self.events, axes or {})


def axis_names(mesh: Any, pp_group: Any = None, tied_group: Any = None, replicas: Any = None) -> dict[str, str]:
    """Process group name -> the axis name the plan's records use (``world``, ``dp``, ``cp``, ``tp``,
    ``dp_cp``, ``pp``, ``tied``), for this rank's stage mesh and groups. DeviceMesh reuses the default
    group for an axis that spans every rank, so a one-stage plan's world-wide all-reduces carry that
    axis's name. ``replicas``: a cp stage's ``("dp_cp",)`` mesh (``parallel.replica_mesh``, a group of its
    own); when it spans every rank, the world-wide all-reduces (gradient clipping) are named ``dp_cp``,
    as the plan's records name them (``search/program/context_parallel.complete``)."""
    import torch.distributed as dist

    world: Any = dist.group.WORLD
    out = {world.group_name: "world"}
    for d in mesh.mesh_dim_names:  # a mesh axis spanning every rank is the default group itself: the axis
        name = mesh.get_group(d).group_name  # names it (the first such axis; search/records.world_axis)
        if out.get(name, "world") == "world":
            out[name] = d
    if replicas is not None:
        out[replicas.get_group().group_name] = "dp_cp"
        if replicas.size() == dist.get_world_size() and out[world.group_name] == "world":
            out[world.group_name] = "dp_cp"
    if pp_group is not None:
        out[pp_group.group_name] = "pp"
    if tied_group is not None:
        out[tied_group.group_name] = "tied"
    return out


def summarize(events: Sequence[tuple[str, str | None, int]], axes: Mapping[str, str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for kind, group, nbytes in events:
        axis = "pp" if kind == "p2p" else axes.get(group or "", f"group:{group}")
        e = out.setdefault(f"{kind}@{axis}", {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += nbytes
    return dict(sorted(out.items()))


def op_bytes(op: str, args: Sequence[Any]) -> int:
    """Bytes of the full tensor a collective moves: all-gather output, reduce-scatter input (also used by
    ``rehearse.py``, so the run and the rehearsal count bytes alike)."""
    if not args:
        return 0
    if op in ("_reduce_scatter_base_", "reduce_scatter_"):
        return tensor_bytes(args[1])
    if op in ("all_gather_into_tensor",):
        return tensor_bytes(args[0]) * int(args[1])
    return tensor_bytes(args[0])


def counted_step(step: int, start: int, steps: int) -> bool:
    """Whether the training loop should count collectives at ``step`` (0-based; run covers [start, steps)).

    The first and the last step of a run: counting puts a Python dispatch mode under every op
    (``bench/runtime_overhead.py`` measured 10-60% slower steps on CPU), and the collectives of a
    step do not change from step to step once the first one has run (pipelining infers shapes at
    its first step, so the last step is the one compared with the prediction).
    """
    return step == start or step == steps - 1


def compare(measured: Mapping[str, Mapping[str, float]], predicted: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Mismatches, in words, between a counted step and the plan's records ([] when they agree): per
    ``kind@axis`` the same keys, equal counts, total bytes within :data:`BYTES_TOL`. All-to-all bytes
    are not compared: expert parallelism's (``backends/torch/moe.py``) follow the routing, and the plan
    records the balanced share; only their sum over the tp group is fixed, which one rank cannot see."""
    problems = []
    for key in sorted(set(measured) | set(predicted)):
        got, want = measured.get(key), predicted.get(key)
        if want is None:
            problems.append(f"{key}: measured {int(got['count'])} ({int(got['bytes'])} B), the plan records none")  # type: ignore[index]
        elif got is None:
            problems.append(
                f"{key}: the plan records {int(want['count'])} ({float(want['bytes']):.0f} B), measured none"
            )
        elif int(got["count"]) != int(want["count"]):
            problems.append(f"{key}: measured {int(got['count'])}, predicted {int(want['count'])}")
        elif key.startswith("all_to_all@"):
            continue
        elif abs(float(got["bytes"]) - float(want["bytes"])) > BYTES_TOL * abs(float(want["bytes"])):
            problems.append(f"{key}: measured {int(got['bytes'])} B, predicted {float(want['bytes']):.0f} B")
    return problems
