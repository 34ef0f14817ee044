"""A stage's backward split in two: B (the input gradient) now, W (the weight gradients) later.

Where it sits: the zero-bubble schedules (``search/schedule.splits_backward``: ``zb_h1``) run each
micro-batch's backward as a ``B`` action, whose input gradient is sent to the previous stage at
once, and a ``W`` action later in the rank's action list that fills the pipeline's bubble.
``backends/torch/schedule.py`` (``P2PPipeline``) calls :func:`backward_input` for ``B`` and
:meth:`Deferred.run` for ``W``. Nothing here is model specific: it works on the autograd graph.

How, without a second backward (the plan prices one backward's FLOPs, ``partita rehearse`` counts
them, and ``tests/runtime/test_wsplit.py`` checks B + W against one plain backward with
``FlopCounterMode``):

* B is ``torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)``. Asked for ``x`` only, the engine
  runs just the nodes on a path to ``x``, and a node with other edges that lead to parameters (a
  matmul's ``AddmmBackward0``: input gradient ``dY W``, weight gradient ``X^T dY``; a norm's backward)
  computes only the outputs on the way to ``x`` (``should_compute_output``): the weight matmul is
  skipped. A pre-hook on each such *split node* keeps the gradient that flowed into it.
* W, per split node: ``torch.autograd.backward([GradientEdge(node, i)], captured, inputs=params)``
  with ``params`` the parameters behind the node's other edges. The engine runs the node again and
  computes only those outputs (``X^T dY``), then the parameter branch below it, accumulating ``.grad``.
* A parameter that a split node reaches both through its parameter branch and through its input
  branch (one weight used at two depths of the stage) cannot be deferred there without running the
  input branch again: such parameters get their gradient in B (they join its ``inputs``), so every
  matmul still runs once.
* A stage whose input needs no gradient (the first stage: token ids) has nothing for B to do: its
  whole backward runs as W.

Parameters are the graph's leaves, so FSDP2's unsharded parameters (ZeRO-1) get W's gradients; the
runner keeps FSDP2's gradient sync off during B and W and runs its post-backward after the stage's
last W. Limits (the emitter refuses these with ``zb_h1``, ``backends/torch/emit.py``): ZeRO-2/3,
whose per-micro-batch reduce-scatter (and reshard) FSDP2 runs when a unit's *input* gradient is done,
which here is B, before W has produced the weight gradients; and activation recompute, because W
unpacks the checkpointed tensors in a second backward pass, which recomputes the block's forward a
second time (more FLOPs than priced). Tensor-parallel (DTensor) weights work: the captured gradients
are DTensors and each W runs the same sharded op as a plain backward.

Memory: the graph of a micro-batch (its activations) stays alive from B until its W, which is the
deferred-weight-gradient memory the schedule's in-flight count prices. B and W retain the graph, so
its saved tensors die only with the graph's nodes, and anything else that holds a node keeps them:
torch's ``ModTracker`` (under ``MemTracker``, which ``partita rehearse`` uses) registers a multi-grad
hook on every module's inputs whose closure holds their ``grad_fn``, a Node <-> closure cycle through
C++ that ``gc`` never frees; every micro-batch's activations then lived to the end of the step (issue 19/15).
So the forward's saved tensors are owned here instead (:class:`SavedTensors`, a ``saved_tensors_hooks``
box the runner opens around a micro-batch's forward and loss) and :meth:`Deferred.run` drops them after
W, whoever still holds the graph. B also clears the input's ``.grad`` it returns (the leaf outlives B
in such a graph). (The rehearsal's own tracker, ``torch_shim.mem_tracker(peak_only=True)``, no longer
installs those hooks: what such a cycle still holds, the input leaf and the gradients the hooks buffer,
is gone from its counts too.)
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

Node = Any  # torch.autograd.graph.Node


class _Slot:
    """What the graph keeps for one saved tensor: its key in the box."""

    __slots__ = ("key", "__weakref__")

    def __init__(self, key: int) -> None:
        self.key = key


class SavedTensors:
    """The tensors one micro-batch's forward saves for its backward, kept here rather than in the
    autograd graph: ``with box.hooks(): out = loss(module(x))``; :meth:`release` frees them all. The
    graph holds a slot per tensor; a tensor whose graph node dies earlier (a branch the output does
    not use) is dropped with its slot, as it would be without the box."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] | None = {}
        self.num_packed = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Slot:
        if self.tensors is None:
            raise RuntimeError("a released SavedTensors box cannot save tensors again")
        slot = _Slot(self.num_packed)
        self.num_packed += 1
        self.tensors[slot.key] = t.detach()  # not t: a saved output would hold its own node (and slot)
        weakref.finalize(slot, self.tensors.pop, slot.key, None)
        return slot

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if self.tensors is None:
            raise RuntimeError("this micro-batch's saved tensors were released after its W: its graph is spent")
        return self.tensors[slot.key]

    def release(self) -> None:
        if self.tensors is not None:
            self.tensors.clear()  # the slots' finalizers hold this dict
        self.tensors = None


@dataclasses.dataclass
class Deferred:
    """What B leaves for W: per split node, the gradients that flowed into it and its parameters."""

    splits: list[tuple[Node, tuple[torch.Tensor | None, ...], list[torch.Tensor]]]
    full: tuple[torch.Tensor, torch.Tensor | None] | None = None  # no input gradient: the whole backward
    saved: SavedTensors | None = None  # the micro-batch's saved tensors, released after W

    def run(self) -> None:
        """The weight gradients (W), accumulated into the parameters' ``.grad``."""
        if self.full is not None:
            out, grad = self.full
            if out.grad_fn is not None:
                torch.autograd.backward(out, grad)
        for node, grads, params in self.splits:
            edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
            if edges and params:
                given = [g for g in grads if g is not None]
                torch.autograd.backward(edges, given, inputs=params, retain_graph=True)
        self.splits, self.full = [], None  # drop the graph: the micro-batch's activations are freed
        if self.saved is not None:  # ... even where something else still holds the graph's nodes
            self.saved.release()
            self.saved = None


def _postorder(root: Node) -> list[Node]:
    """The graph's nodes below ``root``, every node after all of its children (iterative DFS)."""
    out: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            out.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack += [(c, False) for c, _ in node.next_functions if c is not None and c not in seen]
    return out


def _children(node: Node) -> list[Node]:
    return [c for c, _ in node.next_functions if c is not None]


def split_nodes(root: Node, target: Node) -> tuple[list[torch.Tensor], list[tuple[Node, list[int]]], set[int]]:
    """``(parameters, [(split node, indices of the parameters behind its parameter edges)], indices
    computed in B)``. The parameters are the graph's leaves other than the input (``AccumulateGrad``
    nodes): the tensors autograd accumulates into, which under FSDP2 are the unsharded parameters.

    A split node lies on a path from ``root`` to a B target (``target``, the stage input's gradient
    edge, or a parameter computed in B) and has an edge off that path that leads to parameters.
    """
    order = _postorder(root)
    leaves = [n for n in order if n is not target and hasattr(n, "variable")]
    params = [n.variable for n in leaves]
    acc = {n: i for i, n in enumerate(leaves)}
    below: dict[Node, frozenset[int]] = {}
    for n in order:
        mine = {acc[n]} if n in acc else set()
        below[n] = frozenset(mine.union(*(below[c] for c in _children(n))))
    in_b: set[int] = set()
    while True:
        targets = {target} | {n for n, i in acc.items() if i in in_b}
        on_path: dict[Node, bool] = {}
        for n in order:
            on_path[n] = n in targets or any(on_path[c] for c in _children(n))
        splits, twice = [], set()
        for n in order:
            if not on_path[n] or n in targets:
                continue
            off = [c for c in _children(n) if not on_path[c] and below[c]]
            if not off:
                continue
            weights = set().union(*(below[c] for c in off))
            twice |= weights & set().union(*(below[c] for c in _children(n) if on_path[c]))
            splits.append((n, sorted(weights)))
        if not twice:
            return params, splits, in_b
        in_b |= twice


def backward_input(
    out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None, saved: SavedTensors | None = None
) -> tuple[torch.Tensor | None, Deferred]:
    """B: the gradient of ``out`` (given ``grad``; None for a scalar loss) with respect to ``inp``.

    ``inp`` must be a leaf (the received boundary activation). Returns its gradient (None when it
    needs none; ``inp.grad`` is cleared) and the :class:`Deferred` weight gradients; parameters that
    cannot be deferred (module docstring) get their ``.grad`` here. ``saved``: the box the forward ran
    under, released by :meth:`Deferred.run`.
    """
    root = out.grad_fn
    if inp is None or not inp.requires_grad or root is None:
        return None, Deferred([], (out, grad), saved)
    target = get_gradient_edge(inp).node
    params, splits, in_b = split_nodes(root, target)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node, _ in splits:

        def keep(grads: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
            captured[node] = tuple(grads)

        handles.append(node.register_prehook(keep))
    early = [params[i] for i in sorted(in_b)]
    # backward(inputs=...) rather than autograd.grad: the same pruning, and module trackers' multi-grad
    # hooks (torch.distributed._tools, used by `partita rehearse`) refuse a leaf under autograd.grad
    try:
        torch.autograd.backward(out, grad, inputs=[inp, *early], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    todo = [(n, captured[n], [params[i] for i in idx]) for n, idx in splits if n in captured]
    dx, inp.grad = inp.grad, None
    return dx, Deferred(todo, saved=saved)
