"""The zero-bubble backward split (``backends/torch/wsplit.py``), in process, on real stages.

For each stage: B (input gradient) then W (weight gradients) gives exactly the gradients of one
plain ``backward`` (bitwise: the same kernels on the same operands), B computes no weight gradient,
and the FLOPs of B + W, counted with ``torch.utils.flop_counter.FlopCounterMode``, equal the plain
backward's, so a schedule that splits the backward does no more work than the plan prices.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from partita.backends.torch import materialize
from partita.backends.torch import parallel as tpar
from partita.backends.torch.wsplit import SavedTensors, backward_input
from partita.frontends import torch_shim
from partita.models.zoo import resolve_model
from tests.runtime.plans import LAYERS


class Twice(nn.Module):
    """One Linear applied at two depths (a weight shared inside the stage) and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(torch.relu(self.n(self.a(x)))))


def _stage(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A stage that takes an activation: the second half of a zoo model, or a hand module."""
    torch.manual_seed(0)
    if name == "twice":
        return Twice(), torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    model = materialize.materialize(resolve_model(name), 0).model
    layers = LAYERS[name]
    tail = layers[len(layers) // 2 :]
    mod = tpar.split_stage(model, tail, layers, torch.device("cpu"))
    x = torch.randn(4, model.fc1.out_features) if name == "mlp" else torch.randn(2, 16, 64)
    with torch.no_grad():
        out = mod(x)
    return mod, x, torch.randn_like(out)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "mlp", "twice", "llama-tiny-bf16"])
def test_split_equals_plain_backward(name: str) -> None:
    """``-bf16``: the forward under ``torch.autocast(bfloat16)``, as a bf16 plan's autocast stages run."""
    name, _, dtype = name.partition("-bf")
    mod, x0, g = _stage(name)
    ref = _stage(name)[0]  # built again from the same seed (a split stage may reference its model)
    x_ref = x0.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=bool(dtype)):
        out = ref(x_ref)
    with FlopCounterMode(display=False) as plain:
        out.backward(g)

    x, box = x0.clone().requires_grad_(), SavedTensors()  # the runner's box: the saved tensors live in it
    with torch.autocast("cpu", torch.bfloat16, enabled=bool(dtype)), box.hooks():
        out = mod(x)
    with FlopCounterMode(display=False) as b:
        dx, deferred = backward_input(out, g, x, box)
    after_b = {n for n, p in mod.named_parameters() if p.grad is not None}
    with FlopCounterMode(display=False) as w:
        deferred.run()

    assert torch.equal(dx, x_ref.grad)
    assert box.tensors is None  # released by W
    used = 0
    for (n, p), (m, q) in zip(mod.named_parameters(), ref.named_parameters()):
        assert n == m
        assert (p.grad is None) == (q.grad is None), n  # a parameter of another stage (a ghost) gets none
        used += q.grad is not None
        assert q.grad is None or torch.equal(p.grad, q.grad), n
    assert used >= 2
    total = plain.get_total_flops()
    assert total > 0 and b.get_total_flops() + w.get_total_flops() == total
    assert 0 < b.get_total_flops() < total  # B really is only part of the backward
    if name == "twice":  # the weight used at two depths gets its gradient in B, the others wait for W
        assert after_b == {"a.weight", "a.bias"}
    else:
        assert after_b == set(), after_b  # every weight gradient waits for W


def test_no_input_gradient_defers_everything() -> None:
    """The first stage (token ids in): B has nothing to compute, W is the whole backward."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    out = lin(x).sum()
    dx, deferred = backward_input(out, None, None)
    assert dx is None and lin.weight.grad is None
    deferred.run()
    torch.testing.assert_close(lin.weight.grad, torch.ones(3, 4).T @ x)


class _Outputs(torch_shim.TorchDispatchMode):
    """Weak references to every tensor the ops under it return (the forward's activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out


def _alive_after_w(boxed: bool, peak_only: bool = False) -> list[int]:
    """Three micro-batches of a gpt2-tiny stage, each F, B, W (wsplit), under torch's ``MemTracker`` (its
    module hooks hold every graph node; ``peak_only``: the one ``partita rehearse`` uses, without them);
    per micro-batch, how many of the forward's op outputs are still alive once its W ran and the
    runner dropped its references."""
    mod, x0, g = _stage("gpt2-tiny")
    alive = []
    with torch_shim.mem_tracker(peak_only=peak_only) as mt:
        for _ in range(3):
            mt.memory_tracking.pop(mod, None)  # the stage root runs once per micro-batch (as rehearse.py does)
            x, box = x0.clone().requires_grad_(), SavedTensors() if boxed else None
            with _Outputs() as rec, box.hooks() if box else contextlib.nullcontext():
                out = mod(x)
            dx, deferred = backward_input(out, g, x, box)
            deferred.run()
            del out, x, dx, deferred, box
            gc.collect()
            alive.append(sum(r() is not None for r in rec.refs))
    return alive


def test_activations_die_at_w_whoever_holds_the_graph() -> None:
    """Issue 19/15: B and W retain the graph, and torch's ``ModTracker`` (under ``MemTracker``) hooks every
    module's inputs with a closure holding their ``grad_fn``, a cycle ``gc`` cannot free: a graph that
    owns its saved tensors kept every micro-batch's activations to the end of the step (the control).
    With the forward under a :class:`SavedTensors` box, W frees them all."""
    assert all(n > 10 for n in _alive_after_w(boxed=False))  # the holder is real: the control leaks
    assert _alive_after_w(boxed=True) == [0, 0, 0]
    # the rehearsal's tracker (torch_shim.mem_tracker(peak_only=True)) keeps no module hooks: no holder
    assert _alive_after_w(boxed=False, peak_only=True) == [0, 0, 0]
