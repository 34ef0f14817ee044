"""The same 2-layer MLP written in torch and in JAX yields IR summaries with equal FLOPs and parameter bytes."""

import math

import torch
from torch import nn

from partita.frontends.trace import trace_handle
from partita.frontends.trace_torch import trace_module
from partita.ir import Prim, dim_size, label_sizes
from partita.models import resolve_model
from partita.passes.pipeline import run_passes


class TorchMLP(nn.Module):
    """Mirror of partita.models.jax_mlp: 64 -> 256 -> 64 with biases, tanh-gelu (flax default), MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(x), approximate="tanh")), y)


def _matmul_flops(graph, batch: int) -> int:
    """2 * product of a contraction's label sizes (the bias add of a fused linear is not a matmul)."""
    env = {"B": batch, "S": 1}
    return sum(
        2 * math.prod(dim_size(d, env) for d in label_sizes(n, graph).values())
        for n in graph.nodes
        if n.prim is Prim.MATMUL
    )


def test_torch_and_jax_mlp_agree() -> None:
    batch = 8
    with torch.device("meta"):
        model = TorchMLP()
    tg = run_passes(
        trace_module(
            model,
            {"x": torch.empty(batch, 64, device="meta"), "y": torch.empty(batch, 64, device="meta")},
            name="torch-mlp",
            dynamic={"x:0": ("B", 1, 1024), "y:0": ("B", 1, 1024)},
        )
    )
    jg = trace_handle(resolve_model("jax-mlp"), batch=batch, seq=1)
    assert tg.param_bytes() == jg.param_bytes() == 4 * (64 * 256 + 256 + 256 * 64 + 64)
    expected = 2 * batch * (64 * 256 + 256 * 64)
    assert _matmul_flops(tg, batch) == _matmul_flops(jg, batch) == expected
    total_t = dim_size(tg.forward_flops(), {"B": batch, "S": 1})
    total_j = dim_size(jg.forward_flops(), {"B": batch, "S": 1})
    # fused torch ops (linear+bias, tanh-gelu, mse_loss) count as the ops JAX decomposes them into;
    # JAX adds two scalar ops (a dtype convert and the mean's divide)
    assert abs(total_t - total_j) <= 2, (total_t, total_j)
