"""PyTorch tracer: every zoo model lowers to a verified IR with exact parameter counts."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from partita.errors import ModelError
from partita.frontends.trace_torch import trace_module
from partita.ir import Prim, Role
from partita.models import resolve_model

FAST = ["gpt2-tiny", "llama-tiny", "mixtral-tiny", "mlp", "resnet-50"]
SLOW = ["gpt2", "bert-large", "vit-huge", "gpt3-1.3b", "llama-7b", "mixtral-8x7b", "llama-70b", "gpt3-39b"]


def _trace(name: str):
    handle = resolve_model(name)
    module = handle.build()
    seq = 16 if handle.config.get("tokens") else 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unmapped op warns: zoo models must have none
        graph = trace_module(module, handle.example_inputs(2, seq), name=name, dynamic=handle.dynamic())
    return handle, module, graph


def _check(name: str) -> None:
    handle, module, graph = _trace(name)
    graph.verify()
    assert graph.num_params() == sum(p.numel() for p in module.parameters()) == handle.num_params()
    assert graph.meta["shapes"] == "symbolic", graph.meta
    assert "B" in graph.symbols
    assert not [n for n in graph.nodes if n.prim is Prim.OPAQUE]
    assert {graph.tensors[i].role for i in graph.inputs} == {Role.INPUT}
    assert len(graph.outputs) == 1 and graph.tensors[graph.outputs[0]].shape == ()  # the loss


@pytest.mark.parametrize("name", FAST)
def test_zoo_model_traces(name: str) -> None:
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_big_zoo_model_traces_on_meta(name: str) -> None:
    _check(name)


def test_gpt2_tiny_ir_details() -> None:
    _, _, g = _trace("gpt2-tiny")
    tied = [t for t in g.params() if t.aliases]
    assert [(t.fqn, t.aliases) for t in tied] == [("transformer.wte.weight", ("lm_head.weight",))]
    assert g.symbols["S"] == (2, 32)
    assert g.tensors["input_ids"].shape[0].name == "B" and g.tensors["input_ids"].shape[1].name == "S"
    prims = {n.prim for n in g.nodes}
    assert {Prim.EMBEDDING, Prim.MATMUL, Prim.ATTENTION, Prim.NORM, Prim.SPLIT, Prim.CROSS_ENTROPY} <= prims
    modules = {n.module for n in g.nodes if n.prim is Prim.MATMUL}
    assert "transformer.h.1.mlp.c_fc" in modules and "lm_head" in modules
    assert any(n.source.endswith(".py:" + n.source.rsplit(":", 1)[-1]) for n in g.nodes if n.source)
    json.dumps(dict(g.nodes[5].attrs))  # attrs are json-able
    split = next(n for n in g.nodes if n.prim is Prim.SPLIT)
    assert len(split.outputs) == 3 and all(any(o in m.inputs for m in g.nodes) for o in split.outputs)


def test_tuple_inputs_and_buffers() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.lin(x)).softmax(-1).sum()

    g = trace_module(Net(), (torch.randn(4, 8),), name="net")
    g.verify()
    roles = {t.fqn: t.role for t in g.tensors.values() if t.fqn}
    assert roles["bn.running_mean"] is Role.BUFFER and roles["lin.weight"] is Role.PARAMETER
    assert g.inputs == ["arg0"] and str(g.tensors["arg0"].shape[0]) == "B"
    assert {Prim.MATMUL, Prim.BATCH_NORM, Prim.SOFTMAX, Prim.REDUCE} <= {n.prim for n in g.nodes}


def test_unmapped_op_becomes_opaque_with_warning() -> None:
    class Odd(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.logcumsumexp(x, 0).sum()

    with pytest.warns(UserWarning, match="logcumsumexp"):
        g = trace_module(Odd(), (torch.randn(4, 3),), name="odd")
    g.verify()
    assert [n.prim for n in g.nodes].count(Prim.OPAQUE) == 1 and g.meta["num_opaque"] == 1


def test_symbolic_failure_falls_back_to_static() -> None:
    class Fixed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(2, 12).sum()  # only valid for batch 4

    g = trace_module(Fixed(), (torch.randn(4, 6),), name="fixed", dynamic={"arg0:0": ("B", 1, 64)})
    g.verify()
    assert g.meta["shapes"] == "static" and "symbolic export failed" in g.meta["dynamic_fallback"]
    assert g.tensors["arg0"].shape == (4, 6) and not g.symbols


def test_data_dependent_model_raises_model_error() -> None:
    from tests.model_fixtures import Branchy

    with pytest.raises(ModelError) as info:
        trace_module(Branchy(), (torch.randn(2, 4),), name="branchy")
    msg = str(info.value)
    assert "branchy" in msg and "Branchy" in msg and "torch.where" in msg
    assert "Traceback" not in msg and msg.count("\n") == 0


@pytest.mark.slow
@pytest.mark.serial  # a time bound: run alone (scripts/test.sh)
def test_gpt3_175b_traces_fast_and_small() -> None:
    """Build + trace 175B on meta in a fresh process: < 60 s and < 4 GiB peak RSS."""
    script = (
        "import time,json,warnings\n"
        "from partita.models import resolve_model\n"
        "from partita.frontends.trace_torch import trace_module\n"
        "t=time.perf_counter(); h=resolve_model('gpt3-175b'); m=h.build()\n"
        "g=trace_module(m,h.example_inputs(2,16),name='gpt3-175b',dynamic=h.dynamic())\n"
        "dt=time.perf_counter()-t; g.verify()\n"
        # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork + exec, so a child of a large pytest
        # process would report the parent's peak
        "hwm=[int(l.split()[1])*1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print(json.dumps({'s':dt,'rss':hwm,"
        "'params':g.num_params(),'nodes':len(g.nodes),'meta':g.meta}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"gpt3-175b: {res['s']:.1f} s, peak RSS {res['rss'] / 2**30:.2f} GiB, {res['nodes']} nodes")
    assert res["meta"]["shapes"] == "symbolic"
    assert 174e9 < res["params"] < 176e9
    assert res["s"] < 60 and res["rss"] < 4 * 2**30
