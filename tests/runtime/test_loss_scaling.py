"""Dynamic loss scaling for f16 plans (``optim.LossScaler``, ``torch.amp.GradScaler`` semantics).

* the scaler alone: a power-of-two scale unscales gradients exactly, an overflow halves the scale and
  drops the step, ``growth_interval`` clean steps double it;
* the plan: every stage of an f16 plan records the overflow check (one float64 all-reduce over the
  world, beside the clipping norm), a bf16 plan does not;
* under torchrun (gloo, 2 ranks): an f16 program trains step for step as the f16 single-device
  reference (``train.reference_run``), its counted collectives include the overflow check and equal
  the program's prediction; a forced overflow (``init_loss_scale`` 2**40) skips every step and halves
  the scale each time, in the run and in the reference alike, while the LR schedule still advances.

Tolerance (fp16 unit roundoff ``U = 2**-11``, 11 significand bits): scaling by a power of two is exact,
so the program and the reference differ only, as in the bf16 case (``test_torch_multiprocess.py``), in
where f16 sums are rounded (per replica and micro-batch vs the whole batch), each rounding a relative
``U``. Losses are means over all tokens, whose rounding errors average out: within ``U`` relative
(measured at most 0.04 U over three steps). Step-1 gradients norm-wise within ``8 U`` per tensor (a few
roundings of partial sums, margin 2x; measured 0.7 U under autocast, 4.7 U under FSDP2's f16 params).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from pathlib import Path

import pytest
import torch

from partita.backends.torch import launch as torch_launch
from partita.backends.torch.emit import emit_torch
from partita.backends.torch.optim import LossScaler
from partita.backends.torch.train import reference_run
from partita.plan import Plan
from partita.search.program.records import world_axis
from tests.runtime.plans import expected, layout, with_records

os.environ.setdefault("OMP_NUM_THREADS", "1")
U_F16 = 2.0**-11  # fp16 unit roundoff
MODEL, STEPS = "gpt2-tiny", 3


class _Opt(torch.optim.SGD):
    """A real SGD that counts its steps."""

    num_steps = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        self.num_steps += 1
        return super().step(closure)


def test_scaler_unscales_exactly_backs_off_and_grows() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = _Opt([w], lr=0.5)
    s = LossScaler(growth_interval=3)
    assert s.scale == 2.0**16 and s.growth_factor == 2.0 and s.backoff_factor == 0.5
    x = torch.tensor([0.3, -1.7, 1e-3])
    s.wrap(lambda out, y: (out * y).sum())(w, x).backward()
    assert torch.equal(w.grad, x * 2.0**16)
    assert float(s.unscale_([w])) == 0.0 and torch.equal(w.grad, x)  # exact: a power of two
    assert s.update(False, opt) and opt.num_steps == 1 and s.scale == 2.0**16
    torch.testing.assert_close(w.detach(), torch.tensor([1.0, 2.0, 3.0]) - 0.5 * x, rtol=0, atol=0)

    before = w.detach().clone()
    w.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert float(s.unscale_([w])) == 1.0
    assert not s.update(True, opt) and opt.num_steps == 1 and s.scale == 2.0**15  # skipped, halved
    assert w.grad is None and torch.equal(w.detach(), before)
    w.grad = torch.tensor([float("nan"), 0.0, 0.0])
    assert float(s.unscale_([w])) == 1.0 and not s.update(True, opt) and s.scale == 2.0**14

    for _ in range(3):  # the growth tracker restarted at the overflow: 3 clean steps to grow
        assert s.scale == 2.0**14
        w.grad = torch.ones(3) * s.scale
        assert float(s.unscale_([w])) == 0.0 and torch.equal(w.grad, torch.ones(3))
        assert s.update(False, opt)
    assert s.scale == 2.0**15 and opt.num_steps == 4
    assert LossScaler.from_training({"init_loss_scale": 2**40}).scale == 2.0**40


def test_f16_plans_record_the_overflow_check() -> None:
    from partita.cluster import parse_cluster
    from partita.passes.annotate import annotate
    from partita.search.entry.planner import plan_graph
    from partita.search.pricing.config import SearchOptions, TrainingConfig
    from tests.search.builders import gpt

    g0 = gpt(4, 1024, 16)
    g = annotate(g0)
    g.layers = g0.layers
    cl = parse_cluster("8xA100-80G+8xV100-32G")
    tr = TrainingConfig(global_batch=16, seq_len=512)
    for allow, dtype in ((True, "f16"), (False, "bf16")):
        plan = plan_graph(g, cl, tr, options=SearchOptions(max_micro_batch=4, num_alternatives=1, allow_f16=allow))
        assert plan.training["dtype"] == dtype
        for s in plan.stages:
            checks = [c for c in s.collectives if c.reason == "loss-scale overflow check"]
            if dtype == "bf16":
                assert checks == []
                continue
            assert len(checks) == 1, s.collectives
            c = checks[0]
            assert (c.kind, c.axis, c.bytes, c.count, c.phase) == ("all_reduce", world_axis(plan), 8.0, 1, "optimizer")


def _f16_plan(name: str, **training: object) -> Plan:
    plan = layout(MODEL, name)
    return with_records(dataclasses.replace(plan, training={**plan.training, "dtype": "f16", **training}), MODEL)


def _launch(tmp: Path, plan: Plan, *extra: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(plan.to_json())
    (tmp / "program_torch.py").write_text(emit_torch(plan, MODEL))
    return torch_launch.run(tmp, steps=STEPS, extra_args=extra)


def _check_counts(res: dict, plan: Plan) -> None:
    for idx, want in expected(MODEL, plan).items():
        key = f"stage{idx}"
        want = {**want, "all_reduce": want.get("all_reduce", 0) + 1}  # + the overflow check
        measured: dict[str, int] = {}
        for k, v in res["collectives"][key].items():  # kind@axis -> kind
            measured[k.split("@")[0]] = measured.get(k.split("@")[0], 0) + v["count"]
        assert measured == want, (key, measured, want)
        checks = [c for c in plan.stages[idx].collectives if c.reason == "loss-scale overflow check"]
        assert [(c.kind, c.axis, c.count) for c in checks] == [("all_reduce", world_axis(plan), 1)]  # plan records it
        assert res["collective_mismatches"].get(key, []) == []  # kinds, axes, counts, bytes: the plan's records


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, precision", [("dp", "autocast"), ("zero3", "fsdp")])
def test_f16_run_matches_reference_and_counts_the_overflow_check(tmp_path: Path, name: str, precision: str) -> None:
    plan = _f16_plan(name)
    res = _launch(tmp_path, plan, "--dump-grads", str(tmp_path / "g"), "--dump-steps", "1")
    ref = reference_run(MODEL, plan.training, STEPS, dump_steps=(1,), precision=precision)
    assert res["loss_scales"] == ref["loss_scales"] == [2.0**16] * STEPS
    assert res["skipped_steps"] == ref["skipped_steps"] == []
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=U_F16, atol=0.0)
    got: dict[str, torch.Tensor] = {}
    for f in glob.glob(str(tmp_path / "g" / "grads_step1_rank*.pt")):
        got.update(torch.load(f))
    assert set(got) == set(ref["grads"][1])
    for n, g in ref["grads"][1].items():  # unscaled: a forgotten 2**16 would be off by 65535x
        err = float((got[n] - g).norm()) / max(float(g.norm()), 1e-30)
        assert err <= 8 * U_F16, (n, err)
    _check_counts(res, plan)
    for rank in range(plan.world_size):  # the overflow check and the step loss, every step, on the host
        assert len(res["host_collectives"][str(rank)]) == 2 * STEPS


@pytest.mark.multiprocess
def test_forced_overflow_skips_steps_and_halves_the_scale(tmp_path: Path) -> None:
    plan = _f16_plan("dp", init_loss_scale=2**40, warmup_steps=2)
    res = _launch(tmp_path, plan)
    ref = reference_run(MODEL, plan.training, STEPS, precision="autocast")
    scales = [2.0**40, 2.0**39, 2.0**38]  # f16 overflows at this scale: every step skipped, halved each time
    assert res["loss_scales"] == ref["loss_scales"] == scales
    assert res["skipped_steps"] == ref["skipped_steps"] == [0, 1, 2]
    assert res["lrs"] == ref["lrs"] == [0.005, 0.01, 0.01]  # the LR schedule advances through skipped steps
    # no step taken: the losses are those of the initial parameters on each step's batch (unscaled)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=U_F16, atol=0.0)
    assert all(3.0 < v < 6.0 for v in res["losses"]), res["losses"]
    _check_counts(res, plan)
