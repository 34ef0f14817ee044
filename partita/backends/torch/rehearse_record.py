"""What the rehearsal records of its measured step (``rehearse._measure``), in one dispatch mode.

Every op of the step passes one Python dispatch mode, :func:`recording_tracker`: the memory tracker
(``torch_shim.mem_tracker(peak_only=True)``: storages by category, the step's peak) with the
:class:`StepRecorder`'s collectives, p2p transfers and FLOPs recorded in the same call. They were two
modes, one inside the other, and each op paid both modes' dispatch and both their checks (the fake
mode active, DTensor, ``prim.device``): the gpt3-13b real-size rehearsal spent 16% of its CPU in the
two modes' own code. What each records, and of which ops, is what the two recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partita.backends.torch import fidelity, p2p_world
from partita.frontends import torch_shim

# A fake tensor's ``.device`` (its device is its own, not its meta storage's) is an op, ``prim.device``,
# that every dispatch mode sees: the autograd engine and the fake mode ask it for most ops they run,
# and in the mixtral-8x7b rehearsal it was 107,000 of a role's 188,000 dispatches. It allocates
# nothing and computes nothing, so the recording tracker passes it straight on.
_DEVICE = torch.ops.prim.device.default
# MemTracker's own exception, kept: under a fake mode ``wait_tensor`` returns its input (eager does not
# allocate a new tensor), where the meta implementation would make a new one
_WAIT = torch_shim.functional_collective_ops()[-1]  # wait_tensor
_active_fake_mode = torch_shim.active_fake_mode
_NO_FORMULA = object()
# The autograd engine's current graph task (-1 outside any backward): a collective issued while it runs was
# issued inside the backward (a gradient bucket's hook, a tp all-reduce), else outside it (the flat sync
# after the schedule). Private, read here only (torch 2.13: torch._C._current_graph_task_id).
_graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)


class StepRecorder:
    """Collectives (kind, process group, bytes), p2p transfers in order, and FLOPs of the ops it is
    given (:meth:`record`, called by :func:`recording_tracker` with each op of the program's own fake
    mode: local ops at local shapes and the collectives DTensor issues, never a DTensor op at its
    global shape)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, int]] = []
        self.in_backward: list[bool] = []  # per event: issued while the autograd engine ran a backward
        self.p2p: list[list[Any]] = []  # [op, peer (global rank), bytes, tag, label, group], in order (pair_p2p)
        self.labels: p2p_world.Label | None = None  # the schedule action of a p2p operation (p2p_world)
        self.flops = 0
        self._formulas: dict[Any, Any] = {}  # op -> its FLOP formula (torch_shim.flop_formula), or _NO_FORMULA

    def record(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        ev = fidelity.collective_event(func, args)
        if ev is not None:
            self.events.append(ev)
            self.in_backward.append(_graph_task() != -1)
            if ev[0] == "p2p":
                self.p2p.append(_p2p_record(func, args, ev, self.labels))
            return
        formula: Any = self._formulas.get(func)
        if formula is None:
            formula = self._formulas[func] = torch_shim.flop_formula(func) or _NO_FORMULA
        if formula is not _NO_FORMULA:
            self.flops += int(formula(*args, **kwargs, out_val=out))

    def summary(self, axes: Any) -> dict[str, dict[str, float]]:
        return fidelity.summarize(self.events, axes)  # type: ignore[return-value]

    def issued_in_backward(self, axes: Any) -> dict[str, int]:
        """``kind@axis`` -> how many of the step's collectives of that key were issued inside a backward."""
        inside = [ev for ev, bw in zip(self.events, self.in_backward) if bw]
        return {k: int(v["count"]) for k, v in fidelity.summarize(inside, axes).items()}


# the data-parallel gradient sync's keys: where the plan says it is issued is a plan decision (Stage.grad_buckets,
# the ZeRO stage and the schedule: FSDP2's reduce-scatter inside the backward, or after the schedule)
SYNC_KEYS = ("all_reduce@dp", "all_reduce@dp_cp", "reduce_scatter@dp", "reduce_scatter@dp_cp")


def phase_mismatches(collectives: Sequence[Any], in_backward: dict[str, int]) -> list[str]:
    """The dp gradient syncs the plan records in phase ``backward`` against those the program issued while a
    backward ran, per key: the all-reduces of ``Stage.grad_buckets`` (inside the last backward) and FSDP2's
    reduce-scatters (ZeRO-2/3 each micro-batch's, ZeRO-1 the last micro-batch's; after the schedule where the
    runner reduces at the end: ``records.stage_collectives``); the others (phase ``optimizer``: the flat
    sync, gradient clipping) must be issued outside it. ``collectives``: the
    stage's ``Stage.collectives``; ``in_backward``: :meth:`StepRecorder.issued_in_backward` of its first rank
    (``rehearse.compare_stage``)."""
    out = []
    for key in SYNC_KEYS:
        kind, axis = key.split("@")
        mine = [c for c in collectives if c.kind == kind and c.axis == axis]
        planned = sum(int(c.count) for c in mine if c.phase == "backward")
        issued = int(in_backward.get(key, 0))
        if mine and issued != planned:
            out.append(
                f"{key}: {issued} issued inside the backward, the plan records {planned} there "
                f"(and {sum(int(c.count) for c in mine) - planned} after the schedule)"
            )
    return out


def recording_tracker(tracker: Any, rec: StepRecorder) -> Any:
    """``tracker`` (``torch_shim.mem_tracker(peak_only=True)``, not yet entered) as the step's one dispatch mode: ``prim.device``
    passed on untracked (no storage, no new peak); DTensor ops left to DTensor (``NotImplemented``: its
    local ops and collectives come back through this mode); every op run under the fake mode the
    tracker was entered in (not DTensor's sharding propagation, ``private_propagation_fake_mode``)
    given to ``rec`` and its outputs tracked as ``MemTracker.__torch_dispatch__`` tracks them (the
    optimizer's state, a backward's temporaries outside activation checkpointing, else activations),
    the peak updated."""
    base = type(tracker)
    refs = tracker._ref_class  # Parameter, Buffer, Gradient, Activation, Temp, Optstate, Other

    class Recording(base):  # type: ignore[valid-type, misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is _DEVICE:
                return func(*args, **(kwargs or {}))
            if DTensor in types:
                return NotImplemented
            kwargs = kwargs or {}
            out = args[0] if func is _WAIT and _active_fake_mode() is not None else func(*args, **kwargs)
            if _active_fake_mode() is not self._fake_mode_on_entry:
                return out
            rec.record(func, args, kwargs, out)
            is_bw = self._mod_tracker.is_bw
            reftype = refs.OPT if self._in_opt else refs.TEMP if is_bw and not self._in_ac else refs.ACT
            _track_each(self, reftype, out)
            self._update_peak_stats(None)  # a peak-only tracker: the step's peak, no module's state
            return out

    tracker.__class__ = Recording
    return tracker


def _track_each(tracker: Any, reftype: Any, out: Any) -> None:
    """``tracker._track(reftype, t)`` for each tensor of an op's output, in ``tree_map_only``'s order
    (tuples and lists walked here, anything else by the pytree)."""
    if isinstance(out, torch.Tensor):
        tracker._track(reftype, out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            _track_each(tracker, reftype, o)
    elif out is not None and not isinstance(out, (int, float, bool)):
        torch_shim.pytree().tree_map_only(torch.Tensor, lambda t: tracker._track(reftype, t), out)


def _p2p_record(func: Any, args: Sequence[Any], ev: tuple[str, str | None, int], labels: Any = None) -> list[Any]:
    """``[op, peer, bytes, tag, label, group]`` of a ``c10d.send`` / ``c10d.recv_`` (``(tensors, group, peer,
    tag)``): the peer as a global rank (the op names it by its rank in the group), the label from the
    runner's schedule (``p2p_world``)."""
    op = "send" if "send" in str(func) else "recv"
    peer = int(args[2]) if len(args) > 2 and isinstance(args[2], int) else -1
    tag = int(args[3]) if len(args) > 3 and isinstance(args[3], int) else 0
    if ev[1] is not None and peer >= 0:
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            peer = dist.get_global_rank(_resolve_process_group(ev[1]), peer)  # type: ignore[arg-type]
        except (RuntimeError, ValueError, KeyError):
            pass
    label = labels(op, peer, tag) if labels is not None else p2p_world.OUTSIDE
    return [op, peer, int(ev[2]), tag, label, str(ev[1] or "")]  # + the group's name: NCCL pairs per group
