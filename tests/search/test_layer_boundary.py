"""A layer's outputs leave it in the boundary layout, in every graph the ILP solves.

Regression: the torch graphs' activation-memory rules (``search/layer/saved.py``) moved the layer-output
pricing under a branch only JAX/test graphs take, so a torch layer could end in a column-parallel
(tp-sharded) output with no gather: the mlp's ``fc1`` as ``colwise`` on its own, the next layer
reading a local shard as a whole tensor ("mat1 and mat2 shapes cannot be multiplied" under torchrun).
"""

from __future__ import annotations

import warnings

from partita.cluster import parse_shorthand
from partita.driver import trace_model
from partita.search.layer.intra_op import solve_layer
from partita.search.pricing.cost_model import CostModel
from partita.search.pricing.mesh import LogicalMesh


def test_torch_layer_output_is_gathered_or_replicated_at_its_boundary() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = trace_model("mlp", batch=32, seq=32).graph
    dev = parse_shorthand("4xCPU").device_types()[0]
    mesh = LogicalMesh((1, 2), ("dp", "tp"), dev, 4)
    for layer in g.layers:
        sol = solve_layer(
            g, layer, mesh, env={"B": 32}, dtype="f32", cost_model=CostModel.for_device(dev), tp_style="torch"
        )
        # fc1 is a layer of its own: a plain "colwise" would hand act a tp shard (a rowwise consumer is
        # not in the layer); "colwise_gather" or replicated are what the runtime can run
        assert sol.tp_plan.get("fc1") != "colwise", (layer.name, sol.tp_plan)
