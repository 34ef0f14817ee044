"""Hand-made Plans for the runtime tests: the layouts the brief lists, for the zoo's tiny models.

The plans are test inputs (the search is not involved); their ``Stage.collectives`` are the search's
own records for the layout (``search/program/records.py`` via :func:`with_records`), without tensor-parallel
ones (those come from the layer ILP). :func:`expected` derives, from first principles and independently
of ``search/program/records.py``, the collective counts the torch runtime must issue per step for each layout;
the plan's records and the collectives counted under torchrun must both equal it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from partita.cluster import parse_shorthand
from partita.plan import Plan, Stage
from partita.search.program import records

LAYERS = {
    "gpt2-tiny": ["embed", "transformer.h.0", "transformer.h.1", "head"],
    "llama-tiny": ["embed", "model.layers.0", "model.layers.1", "head"],
    "mlp": ["fc1", "act", "fc2"],
}


def tp_placements(model: str, layers: list[str], contiguous_qkv: bool = False) -> dict[str, tuple[str, str]]:
    """Megatron-style column/row placements on the tp axis for the stage's layers (dp axis R).

    GPT-2's fused q|k|v weight is split per chunk (``SS(1,3)``, what the search picks since
    ``passes/fused_split.py``), or contiguously (``S(1)``) with ``contiguous_qkv``.
    """
    out: dict[str, str] = {}
    qkv = ("S(1)", "S(0)") if contiguous_qkv else ("SS(1,3)", "SS(0,3)")
    for name in layers:
        if model == "gpt2-tiny" and name.startswith("transformer.h."):
            # transformers' Conv1D keeps weight as [in, out]: column-parallel = S(1), row-parallel = S(0)
            out |= {f"{name}.attn.c_attn.weight": qkv[0], f"{name}.attn.c_attn.bias": qkv[1]}
            out |= {f"{name}.attn.c_proj.weight": "S(0)", f"{name}.mlp.c_fc.weight": "S(1)"}
            out |= {f"{name}.mlp.c_fc.bias": "S(0)", f"{name}.mlp.c_proj.weight": "S(0)"}
        elif model == "gpt2-tiny" and name == "embed":
            out["transformer.wte.weight"] = "S(0)"  # vocab-parallel embedding (tied with lm_head)
        elif model == "llama-tiny" and name.startswith("model.layers."):
            for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                out[f"{name}.{p}.weight"] = "S(0)"
            out |= {f"{name}.self_attn.o_proj.weight": "S(1)", f"{name}.mlp.down_proj.weight": "S(1)"}
        elif model == "llama-tiny" and name == "head":
            out["lm_head.weight"] = "S(0)"
        elif model == "mlp" and name == "fc1":
            out |= {"fc1.weight": "S(0)", "fc1.bias": "S(0)"}
        elif model == "mlp" and name == "fc2":
            out["fc2.weight"] = "S(1)"
    return {k: ("R", v) for k, v in out.items()}


def image_inputs(size: int) -> Callable[[int, int, str], dict[str, Any]]:
    """The example inputs of the runtime tests' image classifiers (``module:function`` specs returning
    ``(model, inputs)``): ``batch`` RGB images ``size`` x ``size`` and labels of 10 classes; zeros on the
    meta device, drawn from torch's seeded generator otherwise (``seq`` is ignored)."""

    def inputs(batch: int, seq: int, device: str) -> dict[str, Any]:
        if device == "meta":
            return {
                "images": torch.zeros(batch, 3, size, size, device=device),
                "labels": torch.zeros(batch, dtype=torch.long),
            }
        return {"images": torch.randn(batch, 3, size, size), "labels": torch.randint(0, 10, (batch,))}

    return inputs


def make_plan(
    model: str,
    stages: list[dict],
    *,
    schedule: str = "1f1b",
    micro_batch_size: int = 2,
    num_micro_batches: int = 2,
    global_batch: int = 8,
    seq_len: int = 16,
    optimizer: str = "adamw",
    dtype: str = "f32",
) -> Plan:
    """``stages``: dicts with layers, ranks, dp, tp and optional zero_stage, recompute, batch_shares."""
    world = sum(len(s["ranks"]) for s in stages)
    cluster = parse_shorthand(f"{world}xCPU")
    out = []
    for i, s in enumerate(stages):
        placements = tp_placements(model, s["layers"], s.get("contiguous_qkv", False)) if s["tp"] > 1 else {}
        out.append(
            Stage(
                index=i,
                layers=tuple(s["layers"]),
                device_type="CPU",
                ranks=tuple(s["ranks"]),
                dp=s["dp"],
                tp=s["tp"],
                zero_stage=s.get("zero_stage", 0),
                recompute=s.get("recompute", "none"),
                batch_shares=tuple(s.get("batch_shares", ())),
                param_placements=placements,
            )
        )
    return with_records(
        Plan(
            model={"name": model, "framework": "torch", "layers": LAYERS[model]},
            cluster={"name": cluster.name, "fingerprint": cluster.fingerprint(), "spec": cluster.to_dict()},
            training={
                "global_batch": global_batch,
                "seq_len": seq_len,
                "dtype": dtype,
                "optimizer": optimizer,
                "lr": 0.01,
            },
            stages=tuple(out),
            schedule=schedule,
            micro_batch_size=micro_batch_size,
            num_micro_batches=num_micro_batches,
            predicted={"step_time_s": 0.05},
            partita_version="0.1.0",
        ),
        model,
    )


@functools.cache
def _graph(model: str):  # noqa: ANN202
    from partita.driver import trace_model

    return trace_model(model, seq=16).graph


def with_records(plan: Plan, model: str) -> Plan:
    """``plan`` with the search's own records (``search/program/records.py``: data parallel, pipeline, tied
    weights, clipping; per step, with bytes) for its layout. The tensor-parallel part of a plan's
    records comes from the layer ILP, which these hand placements skip: a tp stage has no tp records
    (the tests check its tp counts against :func:`expected`)."""
    bare = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, collectives=()) for s in plan.stages))
    return records.complete(bare, _graph(model))


BUCKET_TEST_BYTES = 20_000  # several buckets per tiny stage (the plans' 25 MiB would hold each stage whole)


def _pp_dp(model: str, a: list[str], b: list[str]) -> Plan:
    """Two equal stages of dp=2 (ZeRO-0) on torch.distributed.pipelining's 1F1B, 2 micro-batches."""
    stages = [dict(layers=a, ranks=[0, 1], dp=2, tp=1), dict(layers=b, ranks=[2, 3], dp=2, tp=1)]
    return make_plan(model, stages, micro_batch_size=2, num_micro_batches=2)


def layout(model: str, name: str) -> Plan:
    """The named test layout for ``model`` (layer lists split in the middle for two stages)."""
    L = LAYERS[model]
    a, b = L[: len(L) // 2], L[len(L) // 2 :]
    one = lambda **kw: [dict(layers=L, **kw)]  # noqa: E731
    table = {
        "dp": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1)),
        "tp": lambda: make_plan(model, one(ranks=[0, 1], dp=1, tp=2), micro_batch_size=4),
        "tp_gather": lambda: make_plan(model, one(ranks=[0, 1], dp=1, tp=2, contiguous_qkv=True), micro_batch_size=4),
        "dp_tp": lambda: make_plan(model, one(ranks=[0, 1, 2, 3], dp=2, tp=2)),
        "zero1": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1, zero_stage=1)),
        "zero2": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1, zero_stage=2)),
        "zero3": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1, zero_stage=3, recompute="full")),
        "tp_full": lambda: make_plan(model, one(ranks=[0, 1], dp=1, tp=2, recompute="full"), micro_batch_size=4),
        "tp_selective": lambda: make_plan(
            model, one(ranks=[0, 1], dp=1, tp=2, recompute="selective"), micro_batch_size=4
        ),
        "uneven": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1, batch_shares=(3, 1))),
        "pp_1f1b": lambda: make_plan(
            model, [dict(layers=a, ranks=[0], dp=1, tp=1), dict(layers=b, ranks=[1], dp=1, tp=1)],
            micro_batch_size=2, num_micro_batches=4,
        ),
        "pp_gpipe": lambda: make_plan(
            model, [dict(layers=a, ranks=[0], dp=1, tp=1), dict(layers=b, ranks=[1], dp=1, tp=1)],
            schedule="gpipe", micro_batch_size=2, num_micro_batches=4,
        ),
        "pp_tp": lambda: make_plan(
            model, [dict(layers=a, ranks=[0, 1], dp=1, tp=2), dict(layers=b, ranks=[2, 3], dp=1, tp=2)],
            micro_batch_size=4, num_micro_batches=2,
        ),
        "pp_zero2": lambda: make_plan(  # issue 15 item 6: ZeRO-2 across a pipeline, 2 stages x dp2
            model, [dict(layers=a, ranks=[0, 1], dp=2, tp=1, zero_stage=2),
                    dict(layers=b, ranks=[2, 3], dp=2, tp=1, zero_stage=2)],
            micro_batch_size=2, num_micro_batches=2,
        ),
        "hetero": lambda: make_plan(
            model, [dict(layers=a, ranks=[0, 1], dp=1, tp=2), dict(layers=b, ranks=[2], dp=1, tp=1)],
            micro_batch_size=4, num_micro_batches=2,
        ),
    }  # fmt: skip
    if name.endswith("_buckets"):  # issue 32: the ZeRO-0 sync in buckets of BUCKET_TEST_BYTES inside the last backward
        plan = table[name[: -len("_buckets")]]() if name != "pp_dp_buckets" else _pp_dp(model, a, b)
        bare = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, collectives=()) for s in plan.stages))
        return with_records(records.with_grad_buckets(bare, _graph(model), cap=BUCKET_TEST_BYTES), model)
    if name.endswith("_bf16"):  # the same layout trained in bf16 (issue 15 item 2)
        plan = table[name[: -len("_bf16")]]()
        return with_records(dataclasses.replace(plan, training={**plan.training, "dtype": "bf16"}), model)
    return table[name]()


# ---- what the torch runtime must issue, from first principles --------------------------------------
# Per micro-batch, per plan layer, with the placements of tp_placements() (torch_tp's Megatron hooks):
# (forward, backward) counts. GPT-2 block, q|k|v split per chunk (SS): c_attn + c_proj and c_fc +
# c_proj are two column/row pairs, as Llama's: 2 AR forward (row outputs), 2 AR backward (column
# input gradients). With a contiguous q|k|v shard ("block, contiguous qkv") c_attn's output is
# gathered (AG) and attention runs on all heads; c_proj then slices its replicated input (its
# backward all-gathers) and all-reduces its output. Llama block: q/k/v + o and gate/up + down are
# two column/row pairs: 2 AR forward, 2 AR backward (column siblings share one input).
# The tied GPT-2 LM head is vocab-column-parallel only where wte is sharded (the stage holding
# "embed"): AG of the logits forward, AR of its input gradient backward. Embedding: AR forward.
TP_LAYER = {
    "gpt2-tiny": {
        "embed": ({"all_reduce": 1}, {}),
        "block": ({"all_reduce": 2}, {"all_reduce": 2}),
        "block, contiguous qkv": ({"all_gather": 1, "all_reduce": 2}, {"all_gather": 1, "all_reduce": 2}),
        "head+embed": ({"all_gather": 1}, {"all_reduce": 1}),
    },
    "llama-tiny": {"block": ({"all_reduce": 2}, {"all_reduce": 2}), "head": ({"all_gather": 1}, {"all_reduce": 1})},
    # fc1 reads the program input: no input gradient, no AR. Split over two stages, fc1 has no row
    # partner (its output is gathered) and fc2 gets a replicated input (sliced; backward all-gathers).
    "mlp": {
        "fc2": ({"all_reduce": 1}, {}),
        "fc1 alone": ({"all_gather": 1}, {}),
        "fc2 alone": ({"all_reduce": 1}, {"all_gather": 1}),
    },
}
# Full recompute re-runs a block's forward, except the last all-reduce (checkpoint early stop: the
# output of the block's last row-parallel module feeds only the residual add, which saves nothing).
TP_RECOMPUTED = {
    "gpt2-tiny": {"block": {"all_reduce": 1}, "block, contiguous qkv": {"all_gather": 1, "all_reduce": 1}},
    "llama-tiny": {"block": {"all_reduce": 1}},
}


def _tp_counts(model: str, s: Stage, m: int) -> dict[str, int]:
    table, out = TP_LAYER[model], {}
    for name in s.layers:
        key = "block" if name not in ("embed", "head") and "block" in table else name
        contiguous = any(v[1] == "S(1)" for k, v in s.param_placements.items() if k.endswith("c_attn.weight"))
        if key == "block" and contiguous:
            key = "block, contiguous qkv"
        if name == "head" and "head+embed" in table:
            key = "head+embed" if "embed" in s.layers else ""
        if model == "mlp" and name in ("fc1", "fc2") and not {"fc1", "fc2"} <= set(s.layers):
            key = f"{name} alone"
        fwd, bwd = table.get(key, ({}, {}))
        again = TP_RECOMPUTED.get(model, {}).get(key, {}) if s.recompute == "full" else {}
        for kind in set(fwd) | set(bwd) | set(again):
            out[kind] = out.get(kind, 0) + m * (fwd.get(kind, 0) + bwd.get(kind, 0) + again.get(kind, 0))
    return out


def expected(model: str, plan: Plan) -> dict[int, dict[str, int]]:
    """Collective counts per stage and step on the stage's first rank, from the layout alone."""
    m, n = plan.num_micro_batches, plan.num_stages
    out: dict[int, dict[str, int]] = {}
    for s in plan.stages:
        e: dict[str, int] = {}

        def add(kind: str, k: int, e: dict[str, int] = e) -> None:
            if k:
                e[kind] = e.get(kind, 0) + k

        # FSDP: one unit per block + the root, counting only units that own parameters: the MLP's
        # "act" block has none and its root none outside fc1 / fc2
        blocks = [x for x in s.layers if x not in ("embed", "head")]
        units = len(blocks) + 1 if model != "mlp" else sum(1 for x in blocks if x != "act")
        if s.dp > 1 and s.zero_stage == 0:
            add("all_reduce", max(1, len(s.grad_buckets)))  # one flattened gradient all-reduce, or one per bucket
        elif s.dp > 1:  # ZeRO-1: gather once, reduce once; ZeRO-2: reduce per micro-batch; ZeRO-3: both
            add("all_gather", units if s.zero_stage < 3 else 2 * m * units)
            add("reduce_scatter", units if s.zero_stage == 1 else m * units)
        if s.tp > 1:
            for kind, k in _tp_counts(model, s, m).items():
                add(kind, k)
        if n > 1:
            others = [t for t in plan.stages if t is not s]
            if s.tp == 1 and others[0].tp > 1:  # hetero stage 1: recv from tp0 of stage 0, grads to both
                add("p2p", m + m * others[0].tp)
            else:  # one neighbour: activations one way, gradients back (tp rank 0 reports)
                add("p2p", 2 * m)
            if model == "gpt2-tiny":  # wte / lm_head tied across the two stages: one all-reduce
                add("all_reduce", 1)
                add("all_gather", int(s.tp > 1 and "embed" in s.layers))  # gathering the tp-sharded wte grad
                add("all_gather", int(s.dp > 1 and s.zero_stage > 0))  # ... and the FSDP-sharded one
        out[s.index] = e
    return out
