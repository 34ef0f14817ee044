"""Context parallelism's runtime scheme (issue 36, ``backends/torch/context_parallel.py``) on 4 gloo ranks.

One ``torchrun`` launch of ``context_parallel_worker.py``: a seeded tiny Llama (f32, 2 blocks, GQA 4/2
heads, 4 samples x 16 tokens) at dp 2 x cp 2 and at cp 4, each rank on its samples' slice of the
sequence (global positions for the rotary embedding, labels shifted before the split, K/V all-gathered
for attention): the loss and every parameter's gradient summed over the ranks equal the single-device
step of the same model with Hugging Face's own attention (rtol 1e-4, atol 1e-5). The K/V all-gathers
and their gradients' reduce-scatters the program ran, counted per rank, are the ones
``search/pricing/context_parallel.py`` prices: two of each per block, each all-gather's output of the
size ``layer_terms`` gives (the traced model's attention shapes at the rank's batch and ``S / cp``), and
equal the Plan's records of that layout (``search/program/context_parallel.attention_records``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
WORKER = Path(__file__).with_name("context_parallel_worker.py")


def test_context_parallel_matches_one_device_and_its_pricing(tmp_path: Path) -> None:
    from partita.cluster import parse_cluster
    from partita.driver import trace_model
    from partita.models import families
    from partita.plan import Plan, Stage
    from partita.search.pricing import context_parallel as cpx
    from partita.search.pricing.cost_model import CostModel
    from partita.search.program import context_parallel as cp_records
    from partita.search.program import records

    out = tmp_path / "cp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(WORKER),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert set(got) == {"dp2_cp2", "dp1_cp4"}

    spec = str(families.write_config(tmp_path / "llama", families.tiny("llama")))
    graph = trace_model(spec, seq=16).graph
    blocks = [lay for lay in graph.layers if cpx.attention_nodes(graph, lay)]
    cl = parse_cluster("4xCPU")
    dev = cl.device_types()[0]
    for key, res in got.items():
        dp, cp = (int(x[2:]) for x in key.split("_"))
        assert res["loss"] == pytest.approx(res["reference_loss"], rel=1e-5)
        assert res["max_grad_diff"] < 1e-5 and res["num_parameters"] == 21  # every parameter, compared in the worker
        link = cpx.cp_link(dev, cp, 1, 4, cl.network_for(dev.name))
        terms = [
            cpx.layer_terms(
                graph, b, CostModel(dev), link, cp=cp, tp=1, micro_batch=4 // dp, local_seq=16 // cp, dtype="f32"
            )
            for b in blocks
        ]
        priced = sum(t.gathered_bytes * t.num_attention for t in terms)
        assert res["collectives"]["all_gather"] == [2 * len(blocks), priced]
        assert res["collectives"]["reduce_scatter"] == [2 * len(blocks), priced]
        # the Plan's records of this layout (search/program/context_parallel.py) are what the scheme issued
        names = [lay.name for lay in graph.layers]
        stage = Stage(0, tuple(names), dev.name, (0, 1, 2, 3), dp=dp, tp=1, cp=cp)
        training = {"global_batch": 4, "seq_len": 16, "dtype": "f32"}
        plan = Plan({"name": "llama", "layers": names}, {"name": "4xCPU"}, training, (stage,), "1f1b", 4 // dp, 1)
        recorded = records.summary(cp_records.attention_records(graph, plan, 0))
        assert [recorded["all_gather@cp"][k] for k in ("count", "bytes")] == res["collectives"]["all_gather"]
        assert [recorded["reduce_scatter@cp"][k] for k in ("count", "bytes")] == res["collectives"]["reduce_scatter"]
