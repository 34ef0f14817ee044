"""The MoE load-balancing loss is kept (``models/moe_aux.py``), per sequence, so any layout sums to it.

The multi-process check (an expert-parallel Mixtral with the loss on, dp=2 x tp=2 x 2 micro-batches,
equal to the single-device run) is the ``mixtral-ep2`` job of ``tests/runtime/test_model_matrix.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partita.backends.torch import materialize
from partita.errors import PlanError
from partita.models import families, moe_aux, resolve_model

COEF = 0.02


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = {**families.tiny("mixtral"), "output_router_logits": True, "router_aux_loss_coef": COEF}
    return str(families.write_config(Path(tmp_path_factory.mktemp("mixtral_aux")), cfg))


def _zero(out: object, labels: torch.Tensor) -> torch.Tensor:
    return torch.zeros(())


def test_it_is_the_models_own_loss_and_any_split_sums_to_it(spec: str) -> None:
    handle = resolve_model(spec)
    assert handle.config["router_aux_loss_coef"] == COEF and "MoE load-balancing" in handle.config["no_pipeline"]
    model = materialize.materialize(handle, 0).model
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    # one sequence: exactly coef x the aux_loss the HF model itself returns
    aux = moe_aux.router_aux(model, global_batch=1)(_zero)
    out = model(input_ids=ids[:1])
    torch.testing.assert_close(aux(out, ids[:1]), COEF * out.aux_loss, rtol=1e-6, atol=1e-7)
    # four sequences in one forward (the reference) = two micro-batches of two (a parallel run)
    aux4 = moe_aux.router_aux(model, global_batch=4)(_zero)
    whole = aux4(model(input_ids=ids), ids)
    parts = aux4(model(input_ids=ids[:2]), ids[:2]) + aux4(model(input_ids=ids[2:]), ids[2:])
    torch.testing.assert_close(whole, parts, rtol=1e-6, atol=1e-7)
    assert whole > 0.5 * COEF  # about top_k x coef for an even router
    # gradients reach the routers
    whole.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_several_stages_are_refused_and_the_trace_says_why(spec: str) -> None:
    from partita.driver import trace_model

    model = resolve_model(spec).build("meta")
    with pytest.raises(PlanError, match="one pipeline stage"):
        moe_aux.router_aux(model, 8, num_stages=2)
    model.config.output_router_logits = False  # not asked for: the loss is left as it is
    assert moe_aux.router_aux(model, 8, num_stages=2)(_zero) is _zero
    graph = trace_model(spec, batch=2, seq=16).graph
    assert "MoE load-balancing" in graph.meta["no_pipeline"]  # the search keeps it to one stage
