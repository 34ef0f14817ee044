"""The tensors a pipeline cut carries: the traced graph's rule (``passes/boundaries.py``, what the search
prices and ``search/program/records.py`` records) and the running model's (``backends/torch/boundary.py``, what
the stage sends) agree at every cut, and the plan's p2p records are the bytes of the tensor sent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partita.backends.torch import parallel as tpar
from partita.backends.torch import stages
from partita.frontends.trace import trace_handle
from partita.models import families, resolve_model
from partita.passes import boundaries
from partita.plan import shares
from partita.search.program import records
from tests.runtime.test_model_matrix import make_plan

SEQ = 16  # the seq_len of make_plan's plans, which the records evaluate shapes at


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_graph_and_runtime_carry_the_same_tensors(tmp_path: Path, family: str) -> None:
    handle = resolve_model(str(families.write_config(tmp_path / family, families.tiny(family))))
    graph = trace_handle(handle, seq=SEQ)
    layers = [lay.name for lay in graph.layers]
    assert layers == ["embed", *stages.guess_blocks(handle.build("meta")), "head"]
    inputs = {k: v for k, v in handle.example_inputs(1, SEQ, "cpu").items() if k != "labels"}
    x = next(iter(inputs.values())) if len(inputs) == 1 else torch.stack(list(inputs.values()), dim=1)
    got, want = [], []
    for c in range(len(layers) - 1):
        cut = stages.cut_elems(handle.build("cpu", seed=0), [layers[: c + 1], layers[c + 1 :]], x)[0]
        got.append(sum(n for _, n in cut))
        want.append(boundaries.cut_elems(graph, c, SEQ))
    assert got == want
    h, a = 64, 4  # families.tiny: hidden 64, 4 heads
    if family == "t5":  # the encoder output crosses every cut before the last cross-attention
        assert want == [2 * SEQ * h] + [2 * SEQ * h + a * SEQ * SEQ] * 3 + [2 * SEQ * h] + [SEQ * h] * 2
        assert "no_pipeline" not in graph.meta
    else:  # the hidden state only: masks and rotary tables depend on no parameter
        assert want == [SEQ * h] * (len(layers) - 1)
    # the plan's p2p records: the packed boundary's bytes for each micro-batch's samples (f32)
    plan = records.complete(make_plan(layers, "pp2", 0), graph)
    half = len(layers) // 2
    wire = tpar.boundary_shapes(handle.build("cpu", seed=0), [layers[:half], layers[half:]], x)[0]
    p2p = [c for c in plan.stages[0].collectives if c.kind == "p2p" and c.phase == "forward"]
    rows = shares(plan.stages[0], plan.micro_batch_size)[0]  # one replica's samples per micro-batch
    assert p2p and {c.bytes for c in p2p} == {wire[0].numel() * 4 * rows}
