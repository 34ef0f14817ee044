"""The zero-bubble backward split (``backends/torch/wsplit.py``), in process, on real stages.

For each stage: B (input gradient) then W (weight gradients) gives exactly the gradients of one
plain ``backward`` (bitwise: the same kernels on the same operands), B computes no weight gradient,
and the FLOPs of B + W, counted with ``torch.utils.flop_counter.FlopCounterMode``, equal the plain
backward's, so a schedule that splits the backward does no more work than the plan prices.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from partita.backends.torch import materialize
from partita.backends.torch import parallel as tpar
from partita.backends.torch.wsplit import backward_input
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

    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=bool(dtype)):
        out = mod(x)
    with FlopCounterMode(display=False) as b:
        dx, deferred = backward_input(out, g, x)
    after_b = {n for n, p in mod.named_parameters() if p.grad is not None}
    with FlopCounterMode(display=False) as w:
        deferred.run()

    assert torch.equal(dx, x_ref.grad)
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
