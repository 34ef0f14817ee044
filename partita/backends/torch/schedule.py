"""Step runners: one training step's forwards and backwards over micro-batches, per layout.

Called by ``torch_train.py``; built by the generated program (``backends/torch/emit.py``) through
:func:`make_runner`. Three runners, chosen from the plan's stage shapes:

* :class:`LocalSchedule` - one stage: gradient accumulation over the micro-batches;
* :class:`TorchPipeline` - every stage has the same ``(dp, tp)`` and batch shares: one
  ``torch.distributed.pipelining.PipelineStage`` per rank on a "pp" group joining the ranks at the
  same mesh coordinate, run by ``ScheduleGPipe`` / ``Schedule1F1B``;
* :class:`P2PPipeline` - stages of different shapes (stage 0 on 2 ranks with tp=2, stage 1 on 1
  rank), ZeRO-2/3 stages, and every schedule beyond GPipe / 1F1B: ``torch.distributed.pipelining``
  assumes one stage per rank of a pp group with equal shapes, so this runner moves boundary
  activations with explicit ``dist.isend`` / ``dist.recv``, re-slicing samples between replicas of
  different data-parallel widths, and executes the rank's action list (``search/pipeline/schedule.py``'s
  ``pipeline_actions``, printed in the program): the same list the cost model simulates. A
  schedule that splits the backward (``zb_h1``, ``zbv``) runs B and W apart (``wsplit.py``); a plan
  with model chunks (interleaved 1F1B with ``v > 1``, ZB-V) runs every chunk of the rank from the one
  list, on one module that holds all their layers (``chunks.py``).

Every runner takes ``loss_fn(output, target)`` already divided by the global token count, so the
sum over replicas and micro-batches is the global mean loss and gradient syncs are plain sums.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.backends.torch import wsplit
from partita.errors import PlanError
from partita.frontends import torch_shim

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def zero_micro_batch(fsdp_modules: Sequence[Any], zero_stage: int, last: bool) -> None:
    """Set FSDP2 up for a micro-batch's backward as the stage's ZeRO level says (``last``: the
    stage's last backward of the step).

    * ZeRO-1: gradients accumulate unsharded; one reduce-scatter after the last micro-batch; the
      parameters stay gathered for the whole step (optimizer state is on the dp shard).
    * ZeRO-2: gradients are reduce-scattered every micro-batch (sharded gradients); parameters stay
      gathered for the whole step.
    * ZeRO-3: both every micro-batch (parameters re-gathered in forward and in backward).
    """
    for m in fsdp_modules:
        m.set_requires_gradient_sync(last or zero_stage >= 2)
        m.set_reshard_after_backward(last or zero_stage >= 3)


def replica_ranges(shares: Sequence[int]) -> list[tuple[int, int]]:
    """Sample range ``[lo, hi)`` of each dp replica inside one micro-batch."""
    out, lo = [], 0
    for n in shares:
        out.append((lo, lo + n))
        lo += n
    return out


class LocalSchedule:
    """A single-stage plan: forward + backward per micro-batch, grads accumulate."""

    def __init__(
        self,
        module: nn.Module,
        num_micro_batches: int,
        loss_fn: LossFn,
        fsdp_modules: Sequence[Any],
        zero_stage: int = 0,
    ) -> None:
        self.module, self.m, self.loss_fn, self.fsdp = module, num_micro_batches, loss_fn, fsdp_modules
        self.zero = zero_stage

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        losses = []
        for k, (x, y) in enumerate(zip(inputs, targets)):
            zero_micro_batch(self.fsdp, self.zero, k == self.m - 1)
            loss = self.loss_fn(self.module(x), y)
            loss.backward()
            losses.append(loss.detach())
        return losses


class TorchPipeline:
    """Equal-shape stages on torch.distributed.pipelining (PipelineStage + ScheduleGPipe/1F1B)."""

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: str,
        num_micro_batches: int,
        loss_fn: LossFn,
        input_example: torch.Tensor,
        output_example: torch.Tensor,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        # Shapes are inferred at the first step: static input_args/output_args metadata is built before
        # the schedule sets has_backward (torch 2.13), so output grads would never be sent back.
        del input_example, output_example
        stage = PipelineStage(module, stage_index, num_stages, device, group=group)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # scale_grads=False: loss_fn is already normalised by the global token count.
        self.schedule = cls(stage, n_microbatches=num_micro_batches, loss_fn=loss_fn, scale_grads=False)
        self.first, self.last = stage_index == 0, stage_index == num_stages - 1
        # The last stage's outputs (the logits) are never read here: without return_outputs=False the
        # schedule keeps every micro-batch's output to the end of the step and then concatenates them
        # (m + m logits at once: gpt3-13b tp8 x pp2 at m = 32 rehearsed 6.4 GiB over its plan, issue 33).
        # torch < 2.6 has no such switch (and keeps them).
        self._step_kw = {"return_outputs": False} if "return_outputs" in inspect.signature(cls.step).parameters else {}

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(torch.cat(list(inputs)), **self._step_kw)
        elif self.last:
            self.schedule.step(target=torch.cat(list(targets)), losses=losses, **self._step_kw)
        else:
            self.schedule.step(**self._step_kw)
        return [x.detach() for x in losses]


class P2PPipeline:
    """Pipeline with explicit point-to-point transfers over stages of any ``(dp, tp)``, executing this
    rank position's action list (``search/schedule.pipeline_actions``).

    Boundary tensors are full (tp-replicated) activations of a replica's samples. Forward: rank
    ``(i, 0)`` of each sending replica sends the samples each receiving replica needs to every tp
    rank of that replica. Backward mirrors it: rank ``(k, 0)`` of each receiving replica returns the
    input gradient to every tp rank of the sending replica (all of them run the SPMD backward).

    ``actions`` is the list the program prints (``"F0.0 F0.1 B0.0 W0.0 ..."``: kind, stage,
    micro-batch). ``F`` runs the forward and sends the output; ``B`` receives the output gradient,
    runs the backward and sends the input gradient; when the schedule splits the backward
    (``zb_h1``, ``zbv``), ``B`` computes only the input gradient and ``W`` later the weight gradients of
    that micro-batch (``backends/torch/wsplit.py``: one backward's FLOPs in all). The gradient syncs
    (``train.forward_backward``) run after :meth:`step`, so after the stage's last ``W``.

    Model chunks (``chunks``: the program's ``PROGRAM["chunks"]``, one ``{stage, position, layers}``
    per virtual stage in model order; interleaved 1F1B and ZB-V): ``stages`` are then the pipeline
    positions, ``stage_index`` this rank's position, ``boundary`` per virtual stage, and ``module``
    holds the layers of all this position's chunks (one module, one optimizer, one gradient sync);
    an action of virtual stage ``s`` runs only ``s``'s layers (:func:`run_chunk`). A boundary between
    two chunks of this position (ZB-V's turn of the V) is a local hand-off: the output is detached into
    the next chunk's leaf input, and its gradient handed back the same way.

    Message streams: a boundary ``s -> s+1`` between two positions carries two streams, the
    activations forward (``F{s}`` sends, ``F{s+1}`` receives) and the gradients backward (``B{s+1}``
    sends, ``B{s}`` receives); each stream has its own process group (:attr:`streams`, keyed
    ``(s+1, backward)``; every rank creates all of them in the same order, as ``new_group`` asks),
    and every ``isend`` / ``recv`` names its stream's group. Why: NCCL pairs the point-to-point
    operations of two ranks on one communicator in issue order and ignores tags, and two streams
    between the same two ranks are not issued in the same order on both sides (ZB-V over 2 rank
    groups, 4 micro-batches: rank 1's ``B2.0`` receive is its 3rd from rank 0, whose 3rd send is
    ``F0.2``'s activation, of the same shape), so on one group a gradient would silently receive an
    activation. Inside one stream both sides follow micro-batch order (a stage runs its F's, and its
    B's, in micro-batch order, as ``pipeline_actions`` lists them; a hand-edited list that does not is a
    wrong order the rehearsal reports, ``p2p_world``), and a stream runs one way, so each group's
    messages pair in order on both sides, on NCCL as on gloo. A single global issue order
    agreed by both sides would need the schedule to interleave the two ranks' actions, which the
    action lists (the plan's) do not. Messages still carry the tag ``2 * (micro * num_virtual +
    stage) (+ 1 backward)`` (gloo matches by tag; the rehearsal names actions from it).
    """

    def __init__(
        self,
        module: nn.Module,
        stages: Sequence[dict[str, Any]],
        stage_index: int,
        rank: int,
        schedule: str,
        num_micro_batches: int,
        loss_fn: LossFn,
        boundary: Sequence[tuple[torch.Size, torch.dtype]],
        device: torch.device,
        fsdp_modules: Sequence[Any] = (),
        zero_stage: int = 0,
        actions: str | None = None,
        chunks: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.module, self.loss_fn, self.m, self.fsdp = module, loss_fn, num_micro_batches, fsdp_modules
        self.zero = zero_stage
        self.s, self.schedule, self.device = stage_index, schedule, device
        if chunks is None:  # one stage per position: virtual stage = position, the module's own layers
            chunks = [{"stage": i, "position": i, "layers": None} for i in range(len(stages))]
        self.chunks = list(chunks)
        self.n = len(self.chunks)  # virtual stages
        mine = [c["stage"] for c in self.chunks if c["position"] == stage_index]
        if any(c["layers"] is not None for c in self.chunks) and not hasattr(module, "layers"):
            raise PlanError(
                f"stage {stage_index}: this model runs through the generic stage splitter (module paths in call "
                "order), which runs one contiguous layer range per rank, not several model chunks.",
                "recompile with a schedule without virtual stages (1f1b or zb_h1).",
            )
        if actions is None:
            from partita.search.pipeline.schedule import pipeline_actions

            num_virtual = len(self.chunks) // len(stages)
            per_rank = pipeline_actions(schedule, len(stages), num_micro_batches, num_virtual)
            actions = " ".join(map(str, per_rank[stage_index]))
        self.actions = parse_actions(actions, mine, num_micro_batches)
        self.split = any(kind == "W" for kind, _, _ in self.actions)
        # ZeRO-1 reduces once after the position's last action, not at a backward: under a split backward
        # (W after B) and with model chunks (one FSDP2 module for every chunk: a chunk's last backward is
        # not the module's)
        self.reduce_at_end = self.split or len(mine) > 1
        if self.reduce_at_end and fsdp_modules and zero_stage >= 2:
            raise PlanError(
                f"stage {stage_index}: schedule {schedule!r} splits the backward, and ZeRO-{zero_stage} would sync "
                "(and reshard) a unit's gradients after every micro-batch's B, before its W (or its other model "
                "chunks) has computed them.",
                "recompile with ZeRO-0 or ZeRO-1 for this stage, or with the 1f1b schedule.",
            )
        me = stages[stage_index]
        pos = list(me["ranks"]).index(rank)
        self.i, self.j = pos // me["tp"], pos % me["tp"]
        self.range = replica_ranges(me["shares"])[self.i]
        self.boundary = list(boundary)
        # per virtual stage of mine: peers (rank, lo, hi), lo/hi relative to my replica's sample range;
        # None where the neighbour is a chunk of this position (local hand-off) or absent
        self.streams = stream_groups(stages, self.chunks)
        self.peers: dict[int, dict[str, list[tuple[int, int, int]] | None]] = {}
        for v in mine:
            prev = self.chunks[v - 1]["position"] if v > 0 else None
            nxt = self.chunks[v + 1]["position"] if v < self.n - 1 else None
            ps, ns = (
                (stages[prev] if prev not in (None, stage_index) else None),
                (stages[nxt] if nxt not in (None, stage_index) else None),
            )
            self.peers[v] = {
                "fwd_recv": _overlaps(ps, self.range, tp0_only=True) if ps else None,
                "fwd_send": (_overlaps(ns, self.range, tp0_only=False) if self.j == 0 else []) if ns else None,
                "bwd_recv": _overlaps(ns, self.range, tp0_only=True) if ns else None,
                "bwd_send": (_overlaps(ps, self.range, tp0_only=False) if self.j == 0 else []) if ps else None,
            }

    def _tag(self, stage: int, k: int, backward: bool) -> int:
        return 2 * (k * self.n + stage) + int(backward)

    def _forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        layers = self.chunks[stage]["layers"]
        return self.module(x) if layers is None else run_chunk(self.module, layers, x)

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, wsplit.SavedTensors | None]] = {}
        deferred: dict[tuple[int, int], wsplit.Deferred] = {}
        handed: dict[tuple[str, int, int], torch.Tensor] = {}  # local hand-offs between chunks of this rank
        losses, handles = [], []
        last_b = [(v, k) for kind, v, k in self.actions if kind == "B"][-1]  # the position's last backward
        for kind, v, k in self.actions:
            first, last, peers = v == 0, v == self.n - 1, self.peers[v]
            if kind == "F":
                if first:
                    x = inputs[k]
                elif peers["fwd_recv"] is None:
                    x = handed.pop(("F", v, k)).requires_grad_()
                else:
                    x = self._recv(peers["fwd_recv"], self.boundary[v - 1], v, k, False)
                    x.requires_grad_(x.is_floating_point())
                box = wsplit.SavedTensors() if self.split else None  # freed at W (wsplit: whoever holds the graph)
                with box.hooks() if box is not None else contextlib.nullcontext():
                    out = self._forward(v, x)
                    if last:
                        out = self.loss_fn(out, targets[k])
                if last:
                    losses.append(out.detach())
                elif peers["fwd_send"] is None:
                    handed[("F", v + 1, k)] = out.detach()
                else:
                    handles += self._send(out.detach(), peers["fwd_send"], v + 1, k, False)
                saved[(v, k)] = (x, out, box)
            elif kind == "B":
                x, out, box = saved.pop((v, k))
                if last:
                    grad = None
                elif peers["bwd_recv"] is None:
                    grad = handed.pop(("B", v, k))
                else:
                    grad = self._recv(peers["bwd_recv"], self.boundary[v], v + 1, k, True)
                # FSDP2 reduces after the position's last action (below) when self.reduce_at_end
                zero_micro_batch(self.fsdp, self.zero, (v, k) == last_b and not self.reduce_at_end)
                if self.split:
                    dx, deferred[(v, k)] = wsplit.backward_input(out, grad, None if first else x, box)
                else:
                    torch.autograd.backward(out, grad)
                    dx = x.grad
                if not first:  # an output that ignores the input still owes the previous stage a gradient
                    dx = dx if dx is not None else torch.zeros_like(x)
                    if peers["bwd_send"] is None:
                        handed[("B", v - 1, k)] = dx
                    else:
                        handles += self._send(dx, peers["bwd_send"], v, k, True)
            else:
                deferred.pop((v, k)).run()
        if self.reduce_at_end and self.fsdp:  # ZeRO-1: one reduce-scatter per unit, after the last action
            torch_shim.fsdp_reduce_grads(self.fsdp[-1])  # the stage root, appended last by setup_stage
        for h in handles:
            h.wait()
        return losses

    def _recv(self, peers: list[tuple[int, int, int]], meta: Any, stage: int, k: int, backward: bool) -> torch.Tensor:
        """Micro-batch ``k``'s message of the stream ``(stage, backward)`` from each of ``peers``."""
        shape, dtype = meta
        lo0, hi0 = self.range
        tag, group = self._tag(stage, k, backward), self.streams[(stage, backward)]
        buf = torch.empty((hi0 - lo0, *shape), dtype=dtype, device=self.device)
        for peer, lo, hi in peers:
            piece = torch.empty((hi - lo, *shape), dtype=dtype, device=self.device)
            dist.recv(piece, src=peer, group=group, tag=tag)
            buf[lo:hi] = piece
        return buf

    def _send(
        self, t: torch.Tensor, peers: list[tuple[int, int, int]], stage: int, k: int, backward: bool
    ) -> list[Any]:
        """Micro-batch ``k``'s message of the stream ``(stage, backward)`` to each of ``peers`` (async)."""
        tag, group = self._tag(stage, k, backward), self.streams[(stage, backward)]
        return [dist.isend(t[lo:hi].contiguous(), dst=peer, group=group, tag=tag) for peer, lo, hi in peers]


def stream_groups(stages: Sequence[dict[str, Any]], chunks: Sequence[dict[str, Any]]) -> dict[tuple[int, bool], Any]:
    """One process group per message stream of the pipeline (:class:`P2PPipeline`'s docstring):
    ``(stage, backward)`` -> the group of the ranks of both positions of the boundary ``stage - 1 ->
    stage``, for every boundary between two positions, in model order, forward then backward. Every rank
    calls this with the same arguments (the program's ``PROGRAM["stages"]`` and ``["chunks"]``), so the
    ``new_group`` calls agree; a rank outside a group gets ``new_group``'s non-member value, never used."""
    out: dict[tuple[int, bool], Any] = {}
    for v in range(1, len(chunks)):
        a, b = chunks[v - 1]["position"], chunks[v]["position"]
        if a == b:  # two chunks of one position: a local hand-off
            continue
        ranks = sorted({*stages[a]["ranks"], *stages[b]["ranks"]})
        for backward in (False, True):
            out[(v, backward)] = dist.new_group(ranks)
    return out


def run_chunk(module: nn.Module, layers: Sequence[str], x: torch.Tensor) -> torch.Tensor:
    """Run only ``layers`` (one model chunk) of a stage module that holds several chunks' layers.

    The module's own ``forward`` runs ``module.layers``; setting them for the call keeps every hook on
    the module (autocast, recompute) in the path."""
    held = getattr(module, "layers")  # noqa: B009 - StageModule.layers (a tuple), not a submodule
    setattr(module, "layers", tuple(layers))  # noqa: B010
    try:
        return module(x)
    finally:
        setattr(module, "layers", held)  # noqa: B010


def parse_actions(text: str, stages: int | Sequence[int], num_micro_batches: int) -> list[tuple[str, int, int]]:
    """``"F0.0 F0.1 B0.0 W0.0 ..."`` (kind, stage, micro-batch) -> ``[(kind, stage, micro-batch)]``,
    checked: every action is one of this rank's ``stages`` (its chunks), and for every stage every
    micro-batch runs F, B and (all or none) W once, in that order."""
    mine = [stages] if isinstance(stages, int) else list(stages)
    out: list[tuple[str, int, int]] = []
    for word in text.split():
        kind, rest = word[:1], word[1:].split(".")
        ok = len(rest) == 2 and all(v.isdigit() for v in rest)
        stage, micro = (int(rest[0]), int(rest[1])) if ok else (-1, -1)
        if kind not in ("F", "B", "W") or stage not in mine or not 0 <= micro < num_micro_batches:
            raise PlanError(
                f"pipeline action {word!r} is not one of stage(s) {mine}'s F/B/W over {num_micro_batches} "
                "micro-batches.",
                "regenerate the program from its plan (`partita compile`).",
            )
        out.append((kind, stage, micro))
    seen = [
        tuple(kind for kind, s, k in out if (s, k) == (v, micro)) for v in mine for micro in range(num_micro_batches)
    ]
    if set(seen) - {("F", "B"), ("F", "B", "W")} or len(set(seen)) != 1:
        raise PlanError(
            f"the action list of stage(s) {mine} does not run each micro-batch's F, then B (then W) once: {seen}.",
            "regenerate the program from its plan (`partita compile`).",
        )
    return out


def _overlaps(other: dict[str, Any], mine: tuple[int, int], tp0_only: bool) -> list[tuple[int, int, int]]:
    """Ranks of stage ``other`` whose replicas share samples with ``mine``: (rank, lo, hi) local to mine.

    ``tp0_only``: just tp rank 0 of each overlapping replica (the one that sends); otherwise every
    tp rank of it (all of them need the tensor for their SPMD forward/backward).
    """
    out = []
    for r, (lo, hi) in enumerate(replica_ranges(other["shares"])):
        a, b = max(lo, mine[0]), min(hi, mine[1])
        if a >= b:
            continue
        tps = [0] if tp0_only else range(other["tp"])
        for j in tps:
            out.append((other["ranks"][r * other["tp"] + j], a - mine[0], b - mine[0]))
    return out
