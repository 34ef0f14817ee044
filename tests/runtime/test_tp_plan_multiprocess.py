"""A tensor-parallel layout chosen by the layer ILP runs as chosen (issue 15 item 1), on 2 gloo ranks.

Phi-3 (tiny config) at tp=2 (global batch = micro-batch = 16, seq 16, f32): ``hand_plan`` fixes the mesh
and the ILP picks every module's tp role (``Stage.tp_plan``): the fused ``gate_up_proj`` column-parallel
per chunk (``SS(0,2)``: rank r holds gate_r | up_r) with ``down_proj`` row-parallel, the fused
``qkv_proj`` and ``lm_head`` column-parallel and gathered (the model slices q|k|v at fixed offsets, so
their output cannot stay sharded). The emitted program writes those roles literally and the runtime
applies them. Phi-3 rather than llama: its strided and gathered roles are what the in-process check
(``test_tp_local.py``, ``LocalTensorMode``) cannot simulate. One launch checks: losses
of 3 steps and gradients after steps 1 and 3 equal the seeded single-device run (f32: rtol 1e-4,
atol 1e-5, as ``test_torch_multiprocess.py``), and the collectives counted in the last step equal the
plan's own records per ``kind@axis`` with the tp ones included (counts equal, bytes within 2%:
the run's own ``fidelity.compare`` reports no mismatch).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess
os.environ.setdefault("OMP_NUM_THREADS", "1")


def test_searched_tp_plan_matches_single_device_and_its_records(tmp_path: Path) -> None:
    from partita.backends.torch import launch as torch_launch
    from partita.backends.torch.emit import emit_torch
    from partita.backends.torch.train import reference_run
    from partita.cluster import parse_shorthand
    from partita.driver import trace_model
    from partita.models import families
    from partita.plan import Plan
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig
    from partita.search.program import records

    spec = str(families.write_config(tmp_path / "phi3", families.tiny("phi3")))
    tr = TrainingConfig(global_batch=16, seq_len=16, dtype="f32")
    plan = hand_plan(trace_model(spec, seq=16).graph, parse_shorthand("2xCPU"), tr, tp=2, pp=1, dp=1, micro_batch=16)
    plan = Plan.from_json(plan.to_json())
    roles = dict(plan.stages[0].tp_plan)
    assert set(roles.values()) == {"colwise", "colwise_gather", "rowwise"}, roles
    assert roles["model.layers.1.mlp.gate_up_proj"] == "colwise" and roles["lm_head"] == "colwise_gather"
    assert plan.stages[0].param_placements["model.layers.1.mlp.gate_up_proj.weight"][1] == "SS(0,2)"
    src = emit_torch(plan, spec)
    assert "'model.layers.1.self_attn.qkv_proj': 'colwise_gather'," in src  # the ILP's choice, literally
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan.to_json())
    (run / "program_torch.py").write_text(src)
    res = torch_launch.run(run, steps=3, extra_args=("--dump-grads", str(run / "g"), "--dump-steps", "1,3"))

    ref = reference_run(spec, plan.training, 3, dump_steps=(1, 3), precision="f32")
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
    for step in (1, 3):
        got: dict[str, torch.Tensor] = {}
        for f in glob.glob(str(run / "g" / f"grads_step{step}_rank*.pt")):
            got.update(torch.load(f))
        assert set(got) == set(ref["grads"][step])
        for n, want in ref["grads"][step].items():
            torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    counted, planned = res["collectives"]["stage0"], records.summary(plan.stages[0].collectives)
    assert set(counted) == set(planned) and "all_reduce@tp" in planned, (counted, planned)
    for key, want in planned.items():
        assert counted[key]["count"] == want["count"], (key, counted[key], want)
        assert counted[key]["bytes"] == pytest.approx(want["bytes"], rel=0.02), (key, counted[key], want)
    assert res["collective_mismatches"].get("stage0", []) == [], res["collective_mismatches"]
