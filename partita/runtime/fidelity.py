"""Collective counting: what a training step really communicated, next to what the plan predicted.

Used by ``torch_train.py`` around each step. ``CommDebugMode`` crashes inside FSDP2's hooks in
torch 2.13 (see FACTS.md), so :class:`CollectiveCounter` is a small ``TorchDispatchMode`` that
records every op in the ``c10d`` (eager ``dist.*``) and ``_c10d_functional`` (DTensor, FSDP)
namespaces: kind, bytes of the full tensor (all-gather output, reduce-scatter input) and process
group size. It sees DTensor redistributions, FSDP2 all-gathers / reduce-scatters (they run in
autograd hooks on the calling thread on CPU), pipelining's and our own send/recv.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def _bytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()`` then ``c.summary()`` -> {kind: {count, bytes}}."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self.events: list[tuple[str, int]] = []

    def __enter__(self) -> CollectiveCounter:
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            kind = KINDS.get(func._opname)
            if kind is not None:
                self.events.append((kind, _op_bytes(func._opname, args)))
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for kind, nbytes in self.events:
            e = out.setdefault(kind, {"count": 0, "bytes": 0})
            e["count"] += 1
            e["bytes"] += nbytes
        return dict(sorted(out.items()))


def _op_bytes(op: str, args: Sequence[Any]) -> int:
    if not args:
        return 0
    if op in ("_reduce_scatter_base_", "reduce_scatter_"):
        return _bytes(args[1])
    if op in ("all_gather_into_tensor",):
        return _bytes(args[0]) * int(args[1])
    return _bytes(args[0])


def predicted_summary(collectives: Sequence[Any]) -> dict[str, dict[str, float]]:
    """A plan stage's ``Collective`` records folded the same way: {kind: {count, bytes}} per step."""
    out: dict[str, dict[str, float]] = {}
    for c in collectives:
        e = out.setdefault(c.kind, {"count": 0, "bytes": 0.0})
        e["count"] += int(c.count)
        e["bytes"] += float(c.bytes) * int(c.count)
    return dict(sorted(out.items()))


def compare(measured: Mapping[str, Mapping[str, float]], predicted: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Human-readable mismatches in collective counts per kind ([] when they agree)."""
    problems = []
    for kind in sorted(set(measured) | set(predicted)):
        m = int(measured.get(kind, {}).get("count", 0))
        p = int(predicted.get(kind, {}).get("count", 0))
        if m != p:
            problems.append(f"{kind}: measured {m}, predicted {p}")
    return problems
