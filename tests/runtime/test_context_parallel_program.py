"""Context parallelism through the emitted program (issue 36): ``partita compile --cp 2`` of a tiny Llama trains
on 4 gloo ranks like one device, per parameter, and its rehearsal matches the plan.

* ``test_emitted_program_writes_the_plans_cp`` (no processes): the program a cp plan emits carries the plan's
  cp degree literally: the stage's ``cp`` in ``PROGRAM``, the mesh ``(dp, cp, tp)``, ``split_sequence`` on
  ``mesh["cp"]`` with the plan's sequence length, FSDP2 over ``rt.replicas`` (the ``dp_cp`` group) at ZeRO > 0;
  a cp = 1 plan's program has none of it; ``partita.parallelize`` refuses a cp plan.
* ``test_compile_cp_trains_like_one_device`` (one ``torchrun`` launch of ``model_matrix_worker.py``, 2 steps
  per job): the directory ``partita compile llama-tiny --cluster 4xCPU --dp 2 --cp 2 --global-batch 8 --seq 16
  --dtype f32`` writes (ZeRO-0), and ``hand_plan(cp=)`` layouts of the same trace: dp 2 x cp 2 at ZeRO-1 with
  full recompute, dp 1 x cp 4 at ZeRO-3, and cp 2 x pp 2 (1F1B on ``torch.distributed.pipelining``, boundaries
  of S / cp tokens between ranks of the same cp coordinate). Losses within 1e-4 of the seeded single-device run; every
  parameter's step-1 gradient and step-2 value at ``backends/torch/parity.py``'s f32 tolerances; the
  collectives counted on the first and last step equal the plan's records (``kind@axis``: counts, bytes within
  2%), among them the K/V all-gathers and dK/dV reduce-scatters on ``cp`` and the gradient sync on ``dp_cp``.
* ``test_rehearse_cp_plan_matches`` (``partita rehearse`` of the compiled directory, of the cp 2 x pp 2 one and
  of dp 1 x cp 4 in f16): collectives, memory and FLOPs match the plan, the cp, dp_cp (and pp) groups named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partita.cli import main
from partita.plan import Plan, read_plan

ROOT = Path(__file__).resolve().parents[2]
SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``partita compile --dp 2 --cp 2`` of a tiny Llama (the Done-when's command)."""
    out = tmp_path_factory.mktemp("cp") / "dp2cp2"
    argv = ["compile", "llama-tiny", "--cluster", "4xCPU", "--dp", "2", "--cp", "2"]
    argv += ["--global-batch", str(BATCH), "--seq", str(SEQ), "--dtype", "f32", "--out", str(out)]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def graph() -> object:
    from partita.driver import trace_model

    return trace_model("llama-tiny", seq=SEQ).graph


def _write(plan: Plan, out: Path) -> Path:
    """``plan`` and its program, as ``partita compile`` writes them."""
    from partita.backends.torch.emit import emit_torch

    out.mkdir()
    (out / "plan.json").write_text(plan.to_json())
    (out / "program_torch.py").write_text(emit_torch(plan, "llama-tiny"))
    return out


@pytest.fixture(scope="module")
def pipelined(graph: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cp 2 x pp 2 (1F1B on torch.distributed.pipelining)."""
    return _write(_hand(graph, 1, 2, 0, "none", pp=2), tmp_path_factory.mktemp("cp") / "cp2pp2")


def _hand(graph: object, dp: int, cp: int, zero: int, recompute: str, pp: int = 1, dtype: str = "f32") -> Plan:
    from partita.cluster import parse_cluster
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    training = TrainingConfig(global_batch=BATCH, seq_len=SEQ, dtype=dtype)
    plan = hand_plan(
        graph,  # type: ignore[arg-type]
        parse_cluster("4xCPU"),
        training,
        tp=1,
        pp=pp,
        dp=dp,
        micro_batch=1,
        zero_stage=zero,
        recompute=recompute,
        cp=cp,
    )
    return Plan.from_json(plan.to_json())


def test_emitted_program_writes_the_plans_cp() -> None:
    import dataclasses

    from partita.backends.torch.emit import emit_torch
    from partita.plan import Stage

    layers = ["embed", "model.layers.0", "model.layers.1", "head"]
    training = {"global_batch": BATCH, "seq_len": SEQ, "dtype": "f32"}
    for dp, cp, zero in ((2, 2, 0), (1, 4, 3)):
        stage = Stage(0, tuple(layers), "CPU", (0, 1, 2, 3), dp=dp, tp=1, cp=cp, zero_stage=zero)
        plan = Plan({"name": "llama-tiny", "layers": layers}, {"name": "4xCPU"}, training, (stage,), "1f1b", 1, 1)
        src = emit_torch(plan, "llama-tiny")
        prog = eval(src.split("PROGRAM = ", 1)[1].split('\nPROGRAM["__file__"]')[0])  # noqa: S307 - our own literal
        assert prog["stages"][0]["cp"] == plan.stages[0].cp and prog["stages"][0]["dp"] == plan.stages[0].dp
        assert f'as {dp}x{cp}x1, ("dp", "cp", "tp")' in src
        assert f'rt.sequence = cpr.split_sequence(module, rt.mesh["cp"], seq_len={SEQ})' in src
        fsdp = "fully_shard(block, mesh=rt.replicas, reshard_after_forward=True)"
        assert (fsdp in src) == (zero == 3)
        plain = emit_torch(dataclasses.replace(plan, stages=(dataclasses.replace(stage, dp=4, cp=1),)), "llama-tiny")
        assert "cpr." not in plain and '"cp"' not in plain and "'cp'" not in plain


def test_parallelize_refuses_a_cp_plan(tmp_path: Path) -> None:
    """``partita.parallelize`` on a live module does not split the sequence: a cp plan is refused, one paragraph."""
    from partita.backends.torch import parallelize
    from partita.errors import PlanError
    from partita.plan import Stage

    layers = ["embed", "model.layers.0", "model.layers.1", "head"]
    stage = Stage(0, tuple(layers), "CPU", (0, 1, 2, 3), dp=2, tp=1, cp=2)
    training = {"global_batch": BATCH, "seq_len": SEQ, "dtype": "f32"}
    plan = Plan({"name": "llama-tiny", "layers": layers}, {"name": "4xCPU"}, training, (stage,), "1f1b", 1, 1)
    with pytest.raises(PlanError, match="cp=2 ranks .context parallelism., which partita.parallelize does not"):
        parallelize.build(None, plan, None, seq_len=SEQ, where=tmp_path)  # type: ignore[arg-type]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compile_cp_trains_like_one_device(compiled: Path, pipelined: Path, graph: object, tmp_path: Path) -> None:
    plans = {
        "llama-dp2cp2": read_plan(compiled / "plan.json"),
        "llama-dp2cp2-z1-full": _hand(graph, 2, 2, 1, "full"),
        "llama-cp4-z3": _hand(graph, 1, 4, 3, "none"),
        "llama-cp2pp2": read_plan(pipelined / "plan.json"),
    }
    for p in plans.values():
        assert [(s.cp, s.tp, len(s.ranks)) for s in p.stages] in ([(2, 1, 4)], [(4, 1, 4)], [(2, 1, 2)] * 2)
    jobs = [
        {"id": k, "spec": "llama-tiny", "plan": p.to_json(), "steps": 2, "parity": True, "count": True}
        for k, p in plans.items()
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(ROOT / "tests/runtime/model_matrix_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    first_error = text.find("Traceback")
    assert proc.returncode == 0, text[first_error : first_error + 6000] if first_error >= 0 else text[-6000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert set(got) == set(plans)
    for job_id, r in got.items():
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(r["reference"]), rtol=1e-4, atol=1e-4, msg=job_id
        )
        bad = [x for x in r["parity"] if not x["ok"]]
        assert not bad, (job_id, bad[:5])
        assert {x["tensor"] for x in r["parity"]} == {"grad@1", "param@2"}
        assert len({x["name"] for x in r["parity"]}) == 21  # every parameter of the tiny Llama
        stages = [f"stage{i}" for i in range(plans[job_id].num_stages)]
        assert r["collective_mismatches"] == {k: [] for k in stages}, (job_id, r["collective_mismatches"])
        for k in stages:
            counted = r["collectives"][k]
            assert {"all_gather@cp", "reduce_scatter@cp"} <= set(counted), (job_id, counted)
            assert any(c.endswith("@dp_cp") for c in counted), (job_id, counted)
            assert ("p2p@pp" in counted) == (len(stages) > 1), (job_id, counted)


@pytest.mark.slow
def test_rehearse_cp_plan_matches(
    compiled: Path, pipelined: Path, graph: object, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # dp 1 x cp 4 in f16: its cp axis spans every rank and its loss-scale overflow check is a world-wide
    # all-reduce the plan records on dp_cp (they once shared the default group and name), and K (f32 after
    # the rotary embedding under autocast) was once gathered in f32: 1.5x the priced bytes
    f16 = _write(_hand(graph, 1, 4, 0, "none", dtype="f16"), tmp_path / "cp4f16")
    for where, names in ((compiled, ()), (pipelined, ("p2p@pp",)), (f16, ())):
        assert main(["rehearse", str(where)]) == 0
        out = capsys.readouterr().out
        assert "rehearsal: the program matches the plan" in out, out
        for name in ("all_gather@cp", "reduce_scatter@cp", "all_reduce@dp_cp", *names):
            assert name in out
