"""Issue 17 under torchrun (gloo): one launch per layout checks, together,

* placement: the per-node torchrun commands `partita run DIR --hostfile F` prints, run as two "nodes" on
  this machine (hosts ``localhost`` and ``127.0.0.1``), train the plan (static rendezvous, own
  ``--nproc-per-node`` and ``--node-rank`` each);
* the process group: the program is started with ``--backend cpu:gloo,cuda:gloo`` (a GPU plan's
  ``cpu:gloo,cuda:nccl`` with gloo for NCCL, which a CPU build lacks); every host-side collective of the
  loop is recorded with its tensor's device and the backend torch's table maps that device to: all CPU
  tensors, all gloo (under an NCCL-only group the same call is refused: ``test_gpu_launch.py``);
* the training config: AdamW with weight decay 0.1, 2 warm-up steps then cosine decay, gradient clipping
  at a norm the gradients exceed: learning rates, pre-clip global norms and losses equal the
  single-device reference (``train.reference_run``) step for step; the clipping all-reduce is counted
  and predicted;
* data: a uint16 token file, memory-mapped; each rank read exactly the windows of its own rows (first
  stage: its replica's inputs, last stage: its replica's labels; middle stages nothing), and the windows
  wrap around a file shorter than the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from partita.backends.torch import launch as torch_launch
from partita.backends.torch.data import rank_rows
from partita.backends.torch.emit import emit_torch
from partita.backends.torch.schedule import replica_ranges
from partita.backends.torch.train import reference_run
from partita.cluster import parse_shorthand
from partita.plan import Plan
from partita.search.program.records import world_axis
from tests.runtime.plans import layout, with_records

pytestmark = pytest.mark.multiprocess
os.environ.setdefault("OMP_NUM_THREADS", "1")
MODEL, STEPS = "gpt2-tiny", 4
# a GPU plan's "cpu:gloo,cuda:nccl" with gloo in NCCL's place (a CPU build of torch has no NCCL): the same
# device-mapped group, whose table (dist.get_backend_config) the program reads for every host collective
BACKEND = "cpu:gloo,cuda:gloo"
TRAINING = {"lr": 0.01, "weight_decay": 0.1, "warmup_steps": 2, "lr_decay": "cosine", "min_lr": 0.001, "grad_clip": 0.5}


def _plan(name: str) -> Plan:
    plan = layout(MODEL, name)
    cl = parse_shorthand(f"{2 * ((plan.world_size + 1) // 2)}xCPU", gpus_per_node=2)  # nodes of 2 ranks
    cluster = {"name": cl.name, "fingerprint": cl.fingerprint(), "spec": cl.to_dict()}
    return with_records(dataclasses.replace(plan, training={**plan.training, **TRAINING}, cluster=cluster), MODEL)


def _expected_reads(plan: Plan, rank: int, num_windows: int) -> list[list[int]]:
    """Token windows rank ``rank`` must read: its replica's rows of every micro-batch, every step."""
    s = plan.stage_of_rank(rank)
    if 0 < s.index < plan.num_stages - 1:
        return []
    sh = s.batch_shares or (plan.micro_batch_size,) * s.dp
    lo, hi = replica_ranges(sh)[s.coords(rank)[0]]
    B, S = plan.training["global_batch"], plan.training["seq_len"]
    rows = rank_rows(plan.num_micro_batches, sum(sh), lo, hi)
    return [[w * S, (w + 1) * S] for t in range(STEPS) for w in ((t * B + r) % num_windows for r in rows)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("name", ["hetero", "zero3"])
def test_placed_launch_matches_reference_with_clipping_schedule_and_token_file(tmp_path: Path, name: str) -> None:
    plan = _plan(name)
    d = tmp_path / "p"
    d.mkdir()
    (d / "plan.json").write_text(plan.to_json())
    (d / "program_torch.py").write_text(emit_torch(plan, MODEL))
    B, S = plan.training["global_batch"], plan.training["seq_len"]
    num_windows = 3 * B - 1  # shorter than 4 steps: the last steps wrap around
    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 128, size=num_windows * S + 3, dtype=np.uint16).tofile(tokens)
    hf = tmp_path / "hosts"
    hf.write_text("localhost device=CPU slots=2\n127.0.0.1 device=CPU slots=2\n")
    out = tmp_path / "result.json"
    args = ("--data-file", str(tokens), "--backend", BACKEND, "--json-out", str(out))
    placed = torch_launch.run(d, steps=STEPS, extra_args=args, hostfile=str(hf))
    assert (d / "launch.sbatch").exists()
    nodes = placed["nodes"]
    assert [n["ranks"] for n in nodes] == [[0, 1], [2]] if name == "hetero" else [[0, 1]]
    port = str(_free_port())
    procs = []
    for n in reversed(nodes):  # the master node last, as any order must work
        cmd = [sys.executable if c == "python" else c for c in n["command"]]
        cmd[cmd.index("--master-port") + 1] = port
        procs.append(subprocess.Popen(cmd, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    res = json.loads(out.read_text())

    ref = reference_run(MODEL, plan.training, STEPS, data_file=str(tokens))
    assert ref["grad_norms"][0] > TRAINING["grad_clip"]  # clipping really scales the gradients
    assert res["lrs"] == pytest.approx(ref["lrs"], rel=1e-12) and res["lrs"][0] == TRAINING["lr"] / 2
    torch.testing.assert_close(torch.tensor(res["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
    for s in plan.stages:  # the plan's records (a hand plan has no ILP tensor-parallel records: plans.with_records)
        left = res["collective_mismatches"].get(f"stage{s.index}", [])
        assert [m for m in left if not (s.tp > 1 and "@tp:" in m)] == [], left
    for s in plan.stages:  # the clipping all-reduce, recorded by the plan and carried by the program
        clip = [c for c in s.collectives if c.reason.startswith("gradient clipping")]
        assert [(c.kind, c.axis, c.count) for c in clip] == [("all_reduce", world_axis(plan), 1)]

    assert res["backend"] == BACKEND and res["data"] == "token_file"
    for rank in range(plan.world_size):
        recs = res["host_collectives"][str(rank)]
        assert len(recs) == STEPS * 2  # the clipping norm and the step loss, every step
        assert {(r["device"], r["backend"]) for r in recs} == {("cpu", "gloo")}
        assert res["data_reads"][str(rank)] == _expected_reads(plan, rank, num_windows), rank
        assert res["peak_host_memory_bytes"][str(rank)] > 0
    assert "step 4/4" in logs[-1] and "tok/s" in logs[-1]  # rank 0's step line
