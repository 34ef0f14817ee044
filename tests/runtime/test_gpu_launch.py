"""Issue 17 without processes: process-group backends, placement by device type, start-up device check,
learning-rate schedule and optimizer from the training record, token-file checks, and the bad inputs
of `partita run` (exit 2, one paragraph, nothing started).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from partita.backends.torch import data as tdata
from partita.backends.torch import hosts, optim
from partita.backends.torch.emit import emit_torch
from partita.backends.torch.parallel import backend_for, check_launch
from partita.backends.torch.train import HostCollectives
from partita.cli import main as cli_main
from partita.cluster import parse_shorthand
from partita.errors import ConfigError, PlanError
from partita.plan import Plan
from tests.runtime.plans import layout


# ---- 1. process groups -------------------------------------------------------------------------
def test_gpu_plan_gets_gloo_for_cpu_tensors_and_nccl_for_cuda() -> None:
    backend = check_launch(2, ["gpu"], 2, cuda=True)
    assert backend == "cpu:gloo,cuda:nccl"
    assert backend_for("cpu", backend) == "gloo" and backend_for("cuda", backend) == "nccl"
    assert check_launch(2, ["cpu"], 2, cuda=False) == "gloo"
    # the bug this replaces: an NCCL-only group has no backend for CPU tensors
    assert backend_for("cpu", "nccl") == ""


def test_host_collective_refuses_a_group_without_a_cpu_backend() -> None:
    """The loop's CPU all-reduce (step loss, clipping norm) is refused before it reaches NCCL."""
    host = HostCollectives("nccl")
    with pytest.raises(PlanError, match="CPU collective would reach"):
        host.all_reduce_sum(torch.zeros(1, dtype=torch.float64))
    assert host.records == []


# ---- 2. placement by device type ---------------------------------------------------------------
def _three_type_plan() -> Plan:
    """A hand-made plan on 8xH100-80G + 16xA100-40G + 8xL4 with rank_map: stage 0 (H100, dp 2 x tp 4),
    stage 1 (A100, dp 2 x tp 8), stage 2 (L4, dp 2 x tp 2) on the first half of the L4 node."""
    cl = parse_shorthand("8xH100-80G+16xA100-40G+8xL4")
    base = layout("gpt2-tiny", "pp_1f1b")
    layers = [("embed", "transformer.h.0"), ("transformer.h.1",), ("head",)]
    mk = lambda i, dev, ranks, dp, tp: dataclasses.replace(  # noqa: E731
        base.stages[0], index=i, device_type=dev, ranks=tuple(ranks), dp=dp, tp=tp, param_placements={},
        layers=layers[i],
    )  # fmt: skip
    stages = (
        mk(0, "H100-80G", range(0, 8), 2, 4),
        mk(1, "A100-40G", range(8, 24), 2, 8),
        mk(2, "L4", range(24, 28), 2, 2),
    )
    cluster = {"name": cl.name, "fingerprint": cl.fingerprint(), "spec": cl.to_dict(), "rank_map": list(range(28))}
    training = {**base.training, "global_batch": 2 * base.micro_batch_size * base.num_micro_batches}
    return dataclasses.replace(base, stages=stages, cluster=cluster, training=training)


def test_place_puts_every_plan_rank_on_its_device_type(tmp_path: Path) -> None:
    plan = _three_type_plan()
    hf = tmp_path / "hosts"
    hf.write_text(
        "l4-0 device=L4 slots=8\na100-0 device=A100-40G\nh100-0 device=H100-80G slots=8\na100-1 device=A100-40G\n"
    )
    nodes = hosts.place(plan, hosts.parse_hostfile(hf))
    devs = hosts.rank_devices(plan)
    assert [n.device for n in nodes] == ["H100-80G", "A100-40G", "A100-40G", "L4"]
    assert [n.nproc for n in nodes] == [8, 8, 8, 4]
    start = 0
    for n in nodes:  # torchrun's static rendezvous: node k's ranks follow node k-1's
        assert n.ranks == tuple(range(start, start + n.nproc))
        assert all(devs[r] == n.device for r in n.ranks)
        start += n.nproc
    assert start == plan.world_size


def test_gpu_type_and_memory_checked_at_start_up() -> None:
    h100 = {"name": "H100-80G", "memory_bytes": 80e9}
    hosts.check_device(h100, "NVIDIA H100 80GB HBM3", int(79.1 * 2**30), rank=3)
    with pytest.raises(PlanError, match="planned for a H100-80G but runs on"):
        hosts.check_device(h100, "NVIDIA A100-SXM4-80GB", int(79 * 2**30), rank=3)
    with pytest.raises(PlanError, match="has 39 GiB"):
        hosts.check_device({"name": "A100-80G", "memory_bytes": 80e9}, "NVIDIA A100-SXM4-40GB", int(39.4 * 2**30), 0)


def _write_plan(d: Path, plan: Plan, model: str = "gpt2-tiny") -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(plan.to_json())
    (d / "program_torch.py").write_text(emit_torch(plan, model))


@pytest.mark.parametrize(
    "text, why",
    [
        ("h100-0 device=H100-80G\n", "does not cover the plan"),
        ("h100-0 device=H100-80G\na100-0 device=A100-40G\na100-1 device=A100-40G\nl4-0 device=L4 slots=2\n", "slots=2"),
        ("h100-0 device=H100-80G\na100-0 device=A100-40G\na100-1 device=A100-40G\nl4-0 device=T4\n", "T4"),
        ("h100-0 slots=8\n", "line 1 ("),
    ],
)
def test_bad_hostfile_exits_2_with_one_paragraph(tmp_path: Path, capsys, text: str, why: str) -> None:
    _write_plan(tmp_path / "p", _three_type_plan())
    (tmp_path / "hosts").write_text(text)
    rc = cli_main(["run", str(tmp_path / "p"), "--dry-run", "--hostfile", str(tmp_path / "hosts")])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and "Traceback" not in err and "partita: error:" in err
    assert not (tmp_path / "p" / "launch.sbatch").exists()


# ---- 3. training config --------------------------------------------------------------------------
def test_warmup_then_cosine_and_optimizer_from_the_plan() -> None:
    tr = {"lr": 0.1, "warmup_steps": 4, "lr_decay": "cosine", "min_lr": 0.01, "optimizer": "adamw", "weight_decay": 0.2}
    f = optim.lr_factor(tr, steps=14)
    assert [f(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(14) == pytest.approx(0.1) and f(40) == pytest.approx(0.1)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    opt = optim.make_optimizer([torch.nn.Parameter(torch.zeros(2))], tr)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["weight_decay"] == 0.2
    assert optim.make_optimizer([torch.nn.Parameter(torch.zeros(2))], {}).param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(ConfigError):
        optim.check_training({"lr_decay": "linear"})


# ---- 4. token files --------------------------------------------------------------------------------
def test_token_file_checks(tmp_path: Path) -> None:
    ok = tmp_path / "ok.bin"
    np.arange(200, dtype=np.uint16).__mod__(100).astype(np.uint16).tofile(ok)
    assert tdata.check_token_file(str(ok), "uint16", 10, 4, vocab=128) == 200
    with pytest.raises(tdata.DataError, match="fewer than one global batch"):
        tdata.check_token_file(str(ok), "uint16", 10, 40, vocab=128)
    with pytest.raises(tdata.DataError, match="outside the model's vocabulary"):
        tdata.check_token_file(str(ok), "uint32", 10, 4, vocab=128)  # uint16 pairs read as uint32
    wide = tmp_path / "wide.bin"
    (np.arange(200) % 100).astype(np.uint32).tofile(wide)
    with pytest.raises(tdata.DataError, match="written as uint32"):
        tdata.check_token_file(str(wide), "uint16", 10, 4, vocab=128)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(tdata.DataError, match="not a multiple of 2"):
        tdata.check_token_file(str(odd), "uint16", 1, 1)
    tf = tdata.TokenFile(str(ok), "uint16", 10, 4, 128)
    x, y = tf.rows(5, [1, 3])  # windows (5*4+1) % 20 = 1 and 3
    assert torch.equal(x[0], torch.arange(10, 20) % 100) and torch.equal(x, y) and tf.reads == [(10, 20), (30, 40)]


def test_bad_token_file_exits_2_before_anything_starts(tmp_path: Path) -> None:
    d = tmp_path / "p"
    _write_plan(d, layout("gpt2-tiny", "dp"))
    short = tmp_path / "short.bin"
    np.zeros(10, dtype=np.uint16).tofile(short)
    before = sorted(os.listdir(d))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "partita.cli", "run", str(d), "--data-file", str(short)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())  # the CLI wraps its paragraph at 100 columns
    assert "holds 10 tokens, fewer than one global batch" in text and "Traceback" not in text
    assert "torch.distributed" not in proc.stderr and sorted(os.listdir(d)) == before  # nothing started


def test_clipping_all_reduce_in_plan_records_and_program() -> None:
    """The training record carries clipping into the plan (one all-reduce per stage) and into the
    program's predicted collectives (the plan's records); a config without it keeps the plan's training
    record as before."""
    from partita.driver import trace_model
    from partita.search.pricing.config import TrainingConfig
    from partita.search.program.records import summary, world_axis

    plain = TrainingConfig(global_batch=8, seq_len=1, dtype="f32")
    assert set(plain.to_dict()) == {"global_batch", "seq_len", "dtype", "optimizer"}
    tr = TrainingConfig(global_batch=8, seq_len=1, dtype="f32", grad_clip=1.0, warmup_steps=2, lr_decay="cosine")
    plan = trace_model("mlp", batch=2, seq=1).plan("2xCPU", tr).plan
    assert plan.training["grad_clip"] == 1.0 and plan.training["lr_decay"] == "cosine"
    for s in plan.stages:
        clip = [c for c in s.collectives if c.reason.startswith("gradient clipping")]
        assert [(c.kind, c.count, c.bytes) for c in clip] == [("all_reduce", 1, 8.0)]
    src = emit_torch(plan, "mlp")
    ns: dict = {}
    exec(src[src.index("PROGRAM = ") : src.index('PROGRAM["__file__"]')], ns)  # noqa: S102 - our own emitted data
    for s in plan.stages:
        got = ns["PROGRAM"]["predicted_collectives"][f"stage{s.index}"]
        clip = [c for c in s.collectives if c.reason.startswith("gradient clipping")]
        assert got == summary(s.collectives) and [c.axis for c in clip] == [world_axis(plan)]
    assert '"grad_clip": 1.0' in emit_torch(plan, "mlp") or "'grad_clip': 1.0" in emit_torch(plan, "mlp")


@pytest.mark.slow
def test_dry_run_of_a_compiled_three_type_plan_places_ranks_by_device_type(tmp_path: Path, capsys) -> None:
    """`partita compile gpt3-6.7b` at global batch 1024 for mixed-lab (16xA100-80G + 16xV100-32G + 8xL4; its
    plan uses all three types: fp16 lets the V100s and L4s hold pipeline stages; at batch 256 the L4s stay
    idle since issue 18's calibration refit), then
    `partita run --dry-run --hostfile` (~15 s, mostly the search): every node's command runs exactly the
    plan ranks of its host's device type."""
    import json

    from partita.plan import read_plan

    d = tmp_path / "p"
    argv = ["compile", "gpt3-6.7b", "--cluster", "mixed-lab", "--global-batch", "1024"]
    assert cli_main([*argv, "--seq", "2048", "--out", str(d)]) == 0
    plan = read_plan(d / "plan.json")
    devs = hosts.rank_devices(plan)
    assert len(set(devs)) == 3, set(devs)
    hf = tmp_path / "hosts"
    hf.write_text(
        "l4-0 device=L4 slots=8\nv100-0 device=V100-32G\na100-0 device=A100-80G slots=8\nv100-1 device=V100-32G\n"
        "a100-1 device=A100-80G\n"
    )
    host_dev = {h.name: h.device for h in hosts.parse_hostfile(hf)}
    capsys.readouterr()
    assert cli_main(["run", str(d), "--dry-run", "--hostfile", str(hf), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    first = 0
    for k, node in enumerate(out["nodes"]):
        cmd = node["command"]
        nproc, rank = int(cmd[cmd.index("--nproc-per-node") + 1]), int(cmd[cmd.index("--node-rank") + 1])
        assert rank == k and cmd[cmd.index("--nnodes") + 1] == str(len(out["nodes"]))
        # torchrun gives node k the global ranks after those of nodes 0..k-1
        placed = list(range(first, first + nproc))
        assert placed == node["ranks"] and {devs[r] for r in placed} == {host_dev[node["host"]]}
        first += nproc
    assert first == plan.world_size
    assert (d / "launch.sbatch").read_text().count("srun ") == len(out["nodes"])


def test_steps_and_checkpoint_interval_come_from_the_training_record(tmp_path: Path) -> None:
    from partita.backends.torch.train import parse_args, resolve_args
    from partita.cli import _plan_steps

    tr = {"global_batch": 8, "steps": 7, "checkpoint_every": 2}
    args = resolve_args(parse_args([]), tr)
    assert (args.steps, args.checkpoint_every) == (7, 2)
    args = resolve_args(parse_args(["--steps", "3", "--checkpoint-every", "0"]), tr)
    assert (args.steps, args.checkpoint_every) == (3, 0)  # the command line wins
    assert resolve_args(parse_args([]), {"global_batch": 8}).steps == 10
    plan = layout("gpt2-tiny", "dp")
    _write_plan(tmp_path / "a", dataclasses.replace(plan, training={**plan.training, "steps": 5}))
    assert _plan_steps(str(tmp_path / "a")) == 5 and _plan_steps(str(tmp_path / "missing")) == 3
