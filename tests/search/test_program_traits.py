"""The priced program's activation width (search/layer/program_traits.py, issue 32)."""

from __future__ import annotations

import dataclasses

import pytest
import sympy

from partita import prims
from partita.cluster import DEVICE_PRESETS
from partita.ir import GraphBuilder, Prim, Role
from partita.passes.layers import group_layers
from partita.search.layer.intra_op import solve_layer
from partita.search.layer.program_traits import program_width
from partita.search.pricing.cost_model import CostModel, Efficiency
from partita.search.pricing.mesh import LogicalMesh

A100 = DEVICE_PRESETS["A100-80G"]


def _chain(framework: str):  # noqa: ANN202
    """x -> three pointwise ops, traced in f32 as the torch tracer records a model built in f32."""
    b, s = sympy.Symbol("B"), sympy.Symbol("S")
    gb = GraphBuilder("chain")
    shp = (b, s, 1024)
    t = gb.tensor("x", shp, "f32", Role.INPUT)
    for name in ("a", "b", "c"):
        (t,) = gb.add(Prim.ELEMENTWISE, [t], [(name, shp, "f32")], prims.elementwise(shp, [shp]))
    gb.outputs.append(t)
    return group_layers(gb.build({"framework": framework}))


def test_megatron_program_moves_activations_in_the_training_dtype() -> None:
    g = _chain("torch")
    mesh = LogicalMesh((1,), ("tp",), A100, 8)
    cm = CostModel(A100, dataclasses.replace(Efficiency(), kernel_overhead_s=0.0))
    env = {"B": 8, "S": 2048}

    def fwd(style: str, dtype: str = "bf16") -> float:
        return solve_layer(g, g.layers[0], mesh, env=env, dtype=dtype, cost_model=cm, tp_style=style).forward_time_s

    # Megatron-LM's Float16Module: every pass reads and writes 2-byte elements, half the traced f32 bytes
    assert fwd("megatron") == pytest.approx(0.5 * fwd("torch"), rel=1e-9)
    assert fwd("torch") == pytest.approx(3 * 2 * 8 * 2048 * 1024 * 4 / (A100.hbm_bandwidth * 0.8), rel=1e-9)
    assert fwd("megatron", "f32") == pytest.approx(fwd("torch", "f32"), rel=1e-9)  # an f32 run moves 4 bytes
    assert program_width(g, "megatron", "bf16") == 2.0 and program_width(g, "torch", "bf16") is None
    assert program_width(_chain("jax"), "megatron", "bf16") is None  # JAX graphs are traced in their dtypes
