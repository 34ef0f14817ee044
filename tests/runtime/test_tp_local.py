"""The ILP's tensor-parallel plan, applied by the runtime, computes what one device computes (in-process).

Issue 15 item 1: ``backends/torch/tp.py`` applies the plan's roles (``Stage.tp_plan``) literally. Here
each model's layers are solved at tp=2 (``SolverCosts``' torch style, micro-batch 16, seq 16), the
runtime applies the roles and placements with ``tensor_parallel``, and both tp ranks are simulated
in this one process with real values (``LocalTensorMode`` over a fake process group of 2 ranks):
the loss and every parameter gradient equal the single-device run's on both ranks (f32).

Families: llama (separate q/k/v, column then row), GPT-NeoX (q|k|v fused per head,
``query_key_value`` column-parallel with its output kept: each rank's contiguous slice is whole
heads and the model views it with ``-1`` heads) and BLOOM (fused q|k|v the ILP gathers: the view
names the head count). GPT-2 and Phi-3 (``_StridedShard`` weights) are left to the gloo launches
(``test_torch_multiprocess.py``): ``LocalTensorMode`` gives every rank rank 0's strided shard.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch


def _plan(spec: str) -> tuple[dict[str, str], dict[str, str]]:
    from partita.cluster import parse_shorthand
    from partita.driver import trace_model
    from partita.search.pipeline.stage_cost import SolverCosts
    from partita.search.pricing.config import TrainingConfig

    g = trace_model(spec, seq=16).graph
    cl = parse_shorthand("2xCPU")
    costs = SolverCosts(g, cl, TrainingConfig(global_batch=16, seq_len=16, dtype="f32"))
    placements, roles = {}, {}
    for i in range(len(g.layers)):
        sol = costs.solution(i, cl.device_types()[0], 2, 16)
        placements |= {k: v[1] for k, v in sol.param_placements.items()}
        roles |= sol.tp_plan
    return placements, roles


@pytest.fixture
def fake_pg():  # noqa: ANN201
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family, kept", [("llama-tiny", "q_proj"), ("gpt_neox", "query_key_value"), ("bloom", None)])
def test_ilp_tp_plan_equals_single_device(tmp_path: Path, fake_pg, family: str, kept: str | None) -> None:  # noqa: ANN001
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from partita.backends.torch import tp as torch_tp
    from partita.backends.torch.parallel import adapter_for
    from partita.models import families, resolve_model

    spec = family if family.endswith("-tiny") else str(families.write_config(tmp_path / family, families.tiny(family)))
    placements, roles = _plan(spec)
    assert "rowwise" in roles.values() and "colwise" in roles.values(), roles
    if kept is not None:
        assert {r for p, r in roles.items() if p.endswith(kept)} == {"colwise"}, roles
    else:
        assert {r for p, r in roles.items() if p.endswith("query_key_value")} <= {"colwise_gather"}, roles
    torch.manual_seed(0)
    model = resolve_model(spec).build("cpu").float().eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (4, 16))
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    mesh = init_device_mesh("cpu", (2,))
    ad = adapter_for(model)
    with LocalTensorMode(2):
        applied = torch_tp.tensor_parallel(model, mesh, placements, ad.fused, roles, ad.strided_attrs)
        assert applied == roles
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for r in (0, 1):
            torch.testing.assert_close(loss._local_tensors[r], want.detach(), rtol=1e-6, atol=1e-6)
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
            per_rank = g._local_tensors.values() if isinstance(g, LocalTensor) else [g]
            for got in per_rank:
                torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
