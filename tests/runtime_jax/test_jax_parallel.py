"""Unit tests of the JAX runtime helpers: layouts, stage split (and its pins), schedules, batch layout.

In-process and device-count independent (the split runs on whatever default device JAX has).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from partita.backends.jax import parallel as jp
from partita.errors import PlanError
from partita.models.jax_gpt import gpt_handle, mlp_handle

GPT_LAYERS = ["wte", "wpe", "blocks_0", "blocks_1", "ln_f", "lm_head"]


def test_partition_spec_per_dim_axes() -> None:
    assert jp.partition_spec(("S(0)", "R"), (8, 4), (2, 2)) == P("dp", None)
    assert jp.partition_spec(("R", "S(1)"), (8, 4), (2, 2)) == P(None, "tp")
    assert jp.partition_spec(("S(0)", "S(0)"), (8, 4), (2, 2)) == P(("dp", "tp"), None)
    assert jp.partition_spec(("R", "S(-1)"), (8, 4), (2, 2)) == P(None, "tp")
    with pytest.raises(PlanError, match="does not split"):
        jp.partition_spec(("R", "S(1)"), (8, 3), (2, 2), "w")
    with pytest.raises(PlanError, match="cannot lay out"):
        jp.partition_spec(("P", "R"), (8, 4), (2, 2), "w")


def test_zero_spec_adds_dp_once() -> None:
    assert jp.zero_spec(P(None, "tp"), (64, 256), (4, 2)) == P(None, ("tp", "dp"))
    assert jp.zero_spec(P(), (256, 64), (4, 1)) == P("dp", None)
    assert jp.zero_spec(P("dp"), (8,), (4, 1)) == P("dp")  # already over dp
    assert jp.zero_spec(P(), (3,), (4, 1)) == P()  # nothing divides: stays replicated


@pytest.mark.parametrize("cut", [[6], [3, 3], [1, 2, 3]])
def test_split_model_composes_to_the_loss(cut: list[int]) -> None:
    h = gpt_handle()
    params = h.init_params(0)
    batch = jp.make_batch(h, 4, 16, 0)
    stage_layers, at = [], 0
    for n in cut:
        stage_layers.append(GPT_LAYERS[at : at + n])
        at += n
    split = jp.split_model(h.loss_fn, h.abstract_params(), batch, GPT_LAYERS, stage_layers)
    flat = jp.flatten(params)
    assert sorted(f for s in split.stages for f in s.param_fqns) == sorted(flat)
    for st, names in zip(split.stages, stage_layers):  # every parameter lands on its layer's stage
        assert all(f.split(".")[1] in names for f in st.param_fqns), (st.index, st.param_fqns)
    values = dict(zip(split.batch_ids, batch))
    for st in split.stages:
        outs = jax.jit(st.apply)({f: flat[f] for f in st.param_fqns}, [values[i] for i in st.inputs])
        values.update(zip(st.outputs, outs))
    np.testing.assert_allclose(values[split.loss_id], jax.jit(h.loss_fn)(params, *batch), rtol=1e-6)
    if len(cut) > 1:  # the residual stream crosses the boundary after blocks_0
        assert [split.avals[i].shape for i in split.stages[0].outputs] == [(4, 16, 64)]


def test_split_model_rejects_unknown_layer_names() -> None:
    h = mlp_handle()
    batch = jp.make_batch(h, 4, 0, 0)
    with pytest.raises(PlanError, match="got no part of the model"):
        jp.split_model(h.loss_fn, h.abstract_params(), batch, ["layer_0", "layer_1"], [["layer_0"], ["layer_1"]])


def test_split_model_stage_order_must_follow_layers() -> None:
    h = mlp_handle()
    batch = jp.make_batch(h, 4, 0, 0)
    with pytest.raises(PlanError, match="model order"):
        jp.split_model(h.loss_fn, h.abstract_params(), batch, ["fc1", "fc2"], [["fc2"], ["fc1"]])


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 8), (4, 2)])
def test_pipeline_schedule_runs_the_plans_action_lists(kind: str, p: int, m: int) -> None:
    """The dispatch order holds every stage's action list of ``search/schedule.pipeline_actions`` (the list
    the cost model simulates) in its own order, merged causally; zero-bubble lists are refused."""
    from partita.search.pipeline.schedule import pipeline_actions

    acts = jp.pipeline_schedule(kind, p, m)
    expected = {(k, s, i) for s in range(p) for i in range(m) for k in "FB"}
    assert set(acts) == expected and len(acts) == len(expected)
    for s, mine in enumerate(pipeline_actions(kind, p, m)):
        assert [a for a in acts if a[1] == s] == [(a.kind, a.stage, a.micro) for a in mine]
    pos = {a: k for k, a in enumerate(acts)}
    for s in range(p):
        for i in range(m):
            assert pos[("F", s, i)] < pos[("B", s, i)]
            if s < p - 1:
                assert pos[("F", s, i)] < pos[("F", s + 1, i)] and pos[("B", s + 1, i)] < pos[("B", s, i)]
    first = [a for a in acts if a[1] == 0]
    if kind == "1f1b":  # stage 0 keeps at most p micro-batches in flight before its first backward
        assert first.index(("B", 0, 0)) == min(p, m)
    else:
        assert first == [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    with pytest.raises(PlanError, match="splits the backward"):
        jp.pipeline_schedule("zb_h1", p, m)


def test_module_pins_reach_module_outputs() -> None:
    """``module_pins`` are applied to the outputs of the named modules, and the split still composes."""
    h = gpt_handle()
    batch = jp.make_batch(h, 4, 16, 0)
    seen: list[tuple[int, tuple, tuple]] = []

    def pin(stage: int, specs: tuple, x: jax.Array) -> jax.Array:
        seen.append((stage, tuple(specs), x.shape))
        return x

    pins = {"blocks_0.attn.qkv": [["qkv-layout"]], "blocks_1.mlp.fc": [["fc-layout"]], "ln_f": [["a"], ["b"]]}
    split = jp.split_model(
        h.loss_fn, h.abstract_params(), batch, GPT_LAYERS, [GPT_LAYERS[:3], GPT_LAYERS[3:]], module_pins=pins, pin=pin
    )
    assert split.pinned == {"blocks_0.attn.qkv": 1, "blocks_1.mlp.fc": 1}  # ln_f has one output, not two
    flat = jp.flatten(h.init_params(0))
    values = dict(zip(split.batch_ids, batch))
    for st in split.stages:
        values.update(zip(st.outputs, st.apply({f: flat[f] for f in st.param_fqns}, [values[i] for i in st.inputs])))
    assert sorted(seen) == [(0, ("qkv-layout",), (4, 16, 192)), (1, ("fc-layout",), (4, 16, 256))]
    np.testing.assert_allclose(values[split.loss_id], h.loss_fn(h.init_params(0), *batch), rtol=1e-6)


def test_replica_batch_uneven_shares_pad_and_weigh() -> None:
    from jax_plan_cases import make_plan

    from partita.backends.jax import train as jax_train
    from partita.backends.jax.emit import emit_jax

    plan = make_plan("jax-mlp", "uneven")
    ns: dict = {}
    exec(compile(emit_jax(plan, "jax-mlp"), "program_jax.py", "exec"), ns)
    prog = ns["PROGRAM"]
    assert prog.stages[0]["shares"] == [1, 1, 2, 4]
    host = [np.arange(16 * 3, dtype=np.float32).reshape(16, 3)]
    (x,), w = jax_train.replica_batch(prog, host)
    assert x.shape == (2, 4, 4, 1, 3) and w.shape == (2, 4, 4)  # (micro-batch, replica, padded share, 1, ...)
    np.testing.assert_array_equal(x[1, 3, :, 0], host[0][12:16])  # replica 3 takes the last 4 of micro-batch 1
    np.testing.assert_array_equal(x[0, 0, 1:], 0)  # padding
    assert np.isclose(w.sum(), 1.0) and (w[0, 0, 1:] == 0).all() and np.isclose(w[0, 3, 0], 1 / 16)
