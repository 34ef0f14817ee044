"""Megatron sequence parallelism (issue 15) runs as the plan says, on gloo ranks.

Llama (tiny config, ``families.tiny("llama")``) at tp=2, micro-batch 4, seq 16, compiled as a hand
layout with ``sequence_parallel=True`` (``search/entry/hand_plan.py`` ->
``search/program/sequence_parallel.py``): the plan's roles are ``colwise_sp`` / ``rowwise_sp`` in the blocks and
``sequence_parallel`` on each block, written literally into the program, which the runtime applies
(``backends/torch/tp.py``: the residual stream between the first and last block holds this rank's 8 of
16 rows, the attention / MLP inputs are all-gathered, the row outputs reduce-scattered, the norms'
weight gradients summed over tp). One launch per case checks: losses of 3 steps and gradients equal the
seeded single-device run, and the collectives counted in the last step equal the plan's own records per
``kind@axis`` (counts equal, bytes within 2%), reduce-scatters and the norms' all-reduces included.

* f32, dp=2 x tp=2 with ZeRO-1 (FSDP2 over dp: the norms' gradient hooks on FSDP2's unsharded
  parameters; 4 ranks, global batch 8): losses and gradients after steps 1 and 3 within rtol 1e-4,
  atol 1e-5 (as ``test_tp_plan_multiprocess.py``);
* bf16, tp=2 (2 ranks, global batch 4; ``torch.autocast``, the cast before each all-gather): against a
  reference under the same autocast,
  with ``test_torch_multiprocess.py``'s tolerances from bf16's unit roundoff ``U = 2**-8``: losses within
  ``U``, step-1 gradients norm-wise within ``8 U`` per tensor (the runs differ only in where partial sums
  are rounded to bf16); step-3 gradients are not compared (Adam turns bf16 noise in near-zero gradients
  into learning-rate-sized differences).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess
os.environ.setdefault("OMP_NUM_THREADS", "1")
U_BF16 = 2.0**-8  # bf16 unit roundoff


@pytest.mark.parametrize(("dtype", "dp", "zero"), [("f32", 2, 1), ("bf16", 1, 0)])
def test_sequence_parallel_plan_matches_single_device_and_its_records(
    tmp_path: Path, dtype: str, dp: int, zero: int
) -> None:
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

    spec = str(families.write_config(tmp_path / "llama", families.tiny("llama")))
    tr = TrainingConfig(global_batch=4 * dp, seq_len=16, dtype=dtype)
    graph = trace_model(spec, seq=16).graph
    kw = {"tp": 2, "pp": 1, "dp": dp, "micro_batch": 4, "zero_stage": zero, "sequence_parallel": True}
    plan = Plan.from_json(hand_plan(graph, parse_shorthand(f"{2 * dp}xCPU"), tr, **kw).to_json())
    assert (plan.stages[0].dp, plan.stages[0].zero_stage) == (dp, zero)
    roles = dict(plan.stages[0].tp_plan)
    assert {"colwise_sp", "rowwise_sp", "sequence_parallel"} <= set(roles.values()), roles
    src = emit_torch(plan, spec)
    assert "'model.layers.0': 'sequence_parallel'," in src  # the plan's decision, literally
    planned = records.summary(plan.stages[0].collectives)
    assert planned["reduce_scatter@tp"]["count"] > 0 and planned["all_gather@tp"]["count"] > 0
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan.to_json())
    (run / "program_torch.py").write_text(src)
    res = torch_launch.run(run, steps=3, extra_args=("--dump-grads", str(run / "g"), "--dump-steps", "1,3"))

    precision = "f32" if dtype == "f32" else "autocast"  # parallel.precision_of: a stage without FSDP2
    assert f"'precision': '{precision}'" in src
    ref = reference_run(spec, plan.training, 3, dump_steps=(1, 3), precision=precision)
    if dtype == "bf16":
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=U_BF16, atol=0.0)
    else:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
    for step in (1, 3) if dtype == "f32" else (1,):
        got: dict[str, torch.Tensor] = {}
        for f in glob.glob(str(run / "g" / f"grads_step{step}_rank*.pt")):
            got.update(torch.load(f))
        assert set(got) == set(ref["grads"][step])
        for n, want in ref["grads"][step].items():
            if dtype == "bf16":
                err = float((got[n] - want).norm()) / max(float(want.norm()), 1e-30)
                assert err <= 8 * U_BF16, (n, err)
            else:
                torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    counted = res["collectives"]["stage0"]
    assert set(counted) == set(planned), (counted, planned)
    for key, want in planned.items():
        assert counted[key]["count"] == want["count"], (key, counted[key], want)
        assert counted[key]["bytes"] == pytest.approx(want["bytes"], rel=0.02), (key, counted[key], want)
    assert res["collective_mismatches"].get("stage0", []) == [], res["collective_mismatches"]
