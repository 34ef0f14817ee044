"""JAX emitter: a :class:`~partita.plan.Plan` -> the readable program ``program_jax.py``.

Last compile stage for JAX models (the PyTorch twin is ``emit_torch.py``); ``driver.py``
writes its output next to ``plan.json`` and ``backends/jax/run.py`` launches it. The program is
the plan as literal data -- per stage its ranks, mesh shape, layers, ZeRO stage and batch shares;
one PartitionSpec per parameter (ZeRO's dp sharding folded in) and per optimizer state; the
activation layouts to pin inside tensor-parallel stages; the pipeline dispatch order; the
collectives the plan predicts -- handed to ``backends/jax/train.py``, which builds the meshes and
jitted steps (its docstring says how each decision becomes JAX).

Context parallelism (``Stage.cp > 1``, issue 36) is refused with one paragraph
(``search/program/context_parallel.refuse_emit``): this emitter builds no cp mesh axis, sequence
split or K/V all-gather; the PyTorch emitter builds them (``backends/torch/context_parallel.py``).

Activation pins come from the plan's op strategies: for every module that owns parameters, the
layout its output leaves with (the producing op's strategy) and, where the consumers want another,
the layout they read (the plan's resharding collective). That needs the plan's IR: the model is
re-traced exactly as ``partita compile`` traced it and must have the plan's ``graph_hash``. The
search records placements and strategies for the first layer of each repeated kind only; the
emitter copies them by position to the other layers of the kind (and says so in the program).
Without the IR (hand-written plans) only layer boundaries are pinned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from partita.backends.jax import fidelity as fid
from partita.backends.jax import parallel as jp
from partita.errors import PlanError
from partita.plan import Plan, chunks_per_rank, placements_to_str, shares
from partita.search.program import context_parallel as cp_records

DEFAULT_LR = 1e-3


def _q(text: str) -> str:
    return json.dumps(text)


def _spec_src(spec: Any) -> str:
    parts = []
    for e in spec:
        parts.append("None" if e is None else _q(e) if isinstance(e, str) else "(" + ", ".join(map(_q, e)) + ")")
    while parts and parts[-1] == "None":
        parts.pop()
    return "P(" + ", ".join(parts) + ")"


def _optimizer_src(training: Mapping[str, Any]) -> str:
    opt = training.get("optimizer", "adam")
    name = str(opt.get("name", "adam") if isinstance(opt, Mapping) else opt)
    lr = float(training.get("lr", DEFAULT_LR))
    if name == "adamw":
        wd = float(training.get("weight_decay", 0.01))
        return f"optax.adamw(learning_rate={lr!r}, b1=0.9, b2=0.999, eps=1e-8, weight_decay={wd!r})"
    if name == "adam":
        return f"optax.adam(learning_rate={lr!r}, b1=0.9, b2=0.999, eps=1e-8)"
    if name == "sgd":
        return f"optax.sgd(learning_rate={lr!r})"
    raise PlanError(f"optimizer {name!r} has no JAX lowering.", "use adam, adamw or sgd.")


def _check(plan: Plan) -> None:
    cp_records.refuse_emit(plan, "JAX")
    if plan.num_stages > 1 and plan.schedule == "interleaved_1f1b" and plan.num_virtual_stages > 1 and not plan.chunked:
        raise PlanError(  # issue 15 item 5: chunks not laid out; plain 1F1B would run under the interleaved price
            f"interleaved 1F1B with {plan.num_virtual_stages} virtual stages cannot be emitted for JAX from a plan "
            "that lists one stage per rank group: the program runs the model chunks the plan lays out (one Stage "
            "per virtual stage, the chunks of a rank group on the same ranks), and this plan lays out none.",
            "recompile with the default search (its JAX schedules leave interleaved_1f1b out), or lay the plan "
            "out in chunks (`partita compile ... --schedule interleaved_1f1b --virtual-stages V` does).",
        )
    if plan.num_stages > 1 and plan.schedule in ("zb_h1", "zbv"):
        # issue 19: the JAX pipeline runs the plan's F and B actions (parallel.pipeline_schedule), B the whole
        # backward. A W apart from B would be the stage's vjp asked for the parameters only: XLA keeps just the
        # ops that lead there, which include the input-gradient chain inside the stage that B already ran, so
        # B + W would cost more than the one backward the plan prices (torch splits per autograd node instead)
        raise PlanError(
            f"schedule {plan.schedule} splits the backward into input and weight gradients, which the JAX "
            "program cannot run (its pipeline runs each stage's whole backward at once).",
            "recompile for JAX with the default search (it leaves zero-bubble schedules out for JAX models).",
        )
    first = shares(plan.stages[0], plan.micro_batch_size)
    for s in plan.stages:
        if shares(s, plan.micro_batch_size) != first or s.dp != plan.stages[0].dp:
            raise PlanError(
                f"stage {s.index} splits micro-batches as {list(shares(s, plan.micro_batch_size))}, stage 0 as "
                f"{list(first)}; the JAX runtime moves activations replica to replica between stages.",
                "compile the plan with the same dp and batch shares on every stage, or use the torch backend.",
            )


def param_specs(
    plan: Plan,
    shapes: Mapping[str, Sequence[int]],
    stage_of: Mapping[str, int],
    placements: Mapping[int, Mapping[str, Sequence[str]]] | None = None,
) -> dict[str, Any]:
    """fqn -> (parameter PartitionSpec, optimizer-state PartitionSpec, plan placement text).

    ``placements`` (stage -> fqn -> placement) overrides the stages' own ``param_placements``.
    """
    out: dict[str, Any] = {}
    for fqn, shape in shapes.items():
        st = plan.stages[stage_of[fqn]]
        known = (placements or {}).get(st.index, st.param_placements)
        placement = tuple(known.get(fqn, ("R",) * 2))
        spec = jp.partition_spec(placement, shape, st.mesh_shape, f"stage {st.index} parameter {fqn}")
        spec0 = spec
        opt_spec = jp.zero_spec(spec, shape, st.mesh_shape) if st.zero_stage >= 1 else spec
        if st.zero_stage >= 3:
            spec = opt_spec
        note = placements_to_str(placement) if fqn in known else "not in plan: (R, R)"
        if st.zero_stage >= 1 and opt_spec != spec0:
            note += f"; ZeRO-{st.zero_stage} over dp"
        out[fqn] = (spec, opt_spec, note)
    return out


# ---- layouts from the plan's IR ---------------------------------------------------------------
def _plan_graph(plan: Plan, handle: Any) -> Any:
    """The IR the plan was searched on (re-traced like ``partita compile``), or None if it differs."""
    if not plan.model.get("graph_hash"):
        return None
    from partita.frontends.trace import TRACE_BATCH, trace_handle

    graph = trace_handle(handle, batch=TRACE_BATCH, seq=int(plan.training.get("seq_len", 0)) or None)
    return graph if graph.hash() == plan.model["graph_hash"] else None


def _complete(graph: Any, stage: Any, notes: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The stage's placements and op strategies with repeated layers filled in from their first one."""
    placements, strategies = dict(stage.param_placements), dict(stage.op_strategies)
    fqn = {t: graph.tensors[t].fqn or t for lay in graph.layers for t in lay.params}
    for lay in graph.layers:
        if lay.name not in stage.layers or not lay.params or any(fqn[t] in placements for t in lay.params):
            continue
        src = next(
            (s for s in graph.layers if s.kind == lay.kind and all(fqn[t] in placements for t in s.params)), None
        )
        if src is None:
            continue
        placements.update({fqn[b]: placements[fqn[a]] for a, b in zip(src.params, lay.params)})
        strategies.update({b: strategies[a] for a, b in zip(src.nodes, lay.nodes) if a in strategies})
        notes.append(f"stage {stage.index} {lay.name}: placements and op strategies copied from {src.name} (same kind)")
    return placements, strategies


def _tp_layout(labels: str, strategy: str | None, reduced: str = "") -> str | None:
    """``S(d)`` / ``R`` / ``P`` on the tp axis for a tensor with these dim labels, or None if unknown."""
    if strategy is None:
        return None
    lab = ""
    for part in strategy.split(","):
        name, _, axis = part.partition("@")
        if axis == "tp":
            lab = name
        elif part != "R" and axis != "dp":
            return None
    if lab and len(lab) != 1:
        return None  # special strategies (vocab-parallel loss): no pin
    if not lab:
        return "R"
    return f"S({labels.index(lab)})" if lab in labels else ("P" if lab in reduced else "R")


def _spec(layout: str, ndim: int) -> Any:
    from jax.sharding import PartitionSpec as P

    dims: list[Any] = [None] * ndim
    if layout.startswith("S("):
        dims[int(layout[2:-1])] = "tp"
    return P(*dims)


def activation_pins(graph: Any, stage: Any, placements: Mapping[str, Any], strategies: Mapping[str, str]) -> dict:
    """module -> per output, the layouts to pin (module docstring); modules that own parameters only."""
    modules = {f.split(".", 1)[1].rsplit(".", 1)[0] for f in placements if f.startswith("params.") and "." in f[7:]}
    consumers: dict[str, list[tuple[Any, int]]] = {}
    for n in graph.nodes:
        for k, t in enumerate(n.inputs):
            consumers.setdefault(t, []).append((n, k))
    pins: dict[str, list[list[Any]]] = {}
    for n in graph.nodes:
        if n.module not in modules:
            continue
        for k, t in enumerate(n.outputs):
            outside = [(c, j) for c, j in consumers.get(t, []) if not _inside(c.module, n.module)]
            if not outside and t not in graph.outputs:
                continue
            ndim = len(graph.tensors[t].shape)
            made = _tp_layout(n.sig.outputs[k], strategies.get(n.name), n.sig.reduced)
            read = {_tp_layout(c.sig.inputs[j], strategies.get(c.name)) for c, j in outside}
            specs = [_spec(made, ndim)] if made not in (None, "P") else []
            if len(read) == 1 and None not in read and read != {made}:
                specs.append(_spec(read.pop(), ndim))
            pins.setdefault(n.module, []).append(specs)
    return {m: v for m, v in sorted(pins.items()) if any(v)}


def _inside(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


class Layouts(NamedTuple):
    """Every layout a plan fixes for a JAX model: the one function both the generated program
    (:func:`emit_jax`) and the decorator (``backends/jax/parallelize.py``) take them from."""

    specs: dict[str, Any]  # fqn -> (parameter PartitionSpec, optimizer-state PartitionSpec, note)
    pins: dict[str, list[list[Any]]]  # flax module -> per output, layouts to pin (activation_pins)
    pinned: set[int]  # stages whose placements come from the plan's IR (layer boundaries pinned too)
    notes: list[str]


def plan_layouts(plan: Plan, handle: Any, shapes: Mapping[str, Sequence[int]], stage_of: Mapping[str, int]) -> Layouts:
    """Parameter specs and activation pins of ``plan`` for the model ``handle`` (re-traced to the plan's
    IR; with tp > 1 repeated layers get their first layer's placements and strategies)."""
    notes: list[str] = []
    graph = _plan_graph(plan, handle)
    if graph is None and plan.model.get("graph_hash"):
        notes.append("the model no longer traces to the plan's graph_hash: only layer boundaries are pinned")
    placements: dict[int, Any] = {}
    pins: dict[str, list[list[Any]]] = {}
    if graph is not None:
        for st in [s for s in plan.stages if s.tp > 1]:  # with tp = 1 every layout is replicated anyway
            placements[st.index], strategies = _complete(graph, st, notes)
            pins.update(activation_pins(graph, st, placements[st.index], strategies))
    specs = param_specs(plan, shapes, stage_of, placements)
    return Layouts(specs, pins, set(placements) if graph is not None else set(), notes)


# ---- the program -------------------------------------------------------------------------------
def emit_jax(plan: Plan, model_spec: str) -> str:
    """The generated program's source for ``plan`` (``model_spec`` names the zoo entry or module:factory)."""
    if plan.training.get("fp8"):  # search/pricing/fp8.py: only the torch program converts linears to FP8
        raise PlanError(
            f"this plan trains in fp8 ({plan.training['fp8']}), but the JAX program has no FP8 training.",
            "compile the JAX model with --precision bf16; FP8 is emitted for PyTorch models (torchao).",
        )
    _check(plan)
    handle = jp.load_model(model_spec)
    abstract = jp.flatten(handle.abstract_params())
    shapes = {k: tuple(v.shape) for k, v in abstract.items()}
    layers = list(plan.model.get("layers") or [lay for s in plan.stages for lay in s.layers])
    st0 = plan.stages[0]
    split = jp.split_model(
        handle.loss_fn,
        handle.abstract_params(),
        handle.example_batch(max(shares(st0, plan.micro_batch_size)), int(plan.training.get("seq_len", 0))),
        layers,
        [s.layers for s in plan.stages],
    )
    stage_of = {f: st.index for st in split.stages for f in st.param_fqns}
    lay = plan_layouts(plan, handle, shapes, stage_of)
    specs, pins, notes = lay.specs, lay.pins, list(lay.notes)
    if plan.num_stages > 1 and plan.schedule == "interleaved_1f1b" and not plan.chunked:
        notes.append(
            f"the plan's interleaved 1F1B (v={plan.num_virtual_stages}) runs as plain 1F1B over its "
            f"{plan.num_stages} stages (one model chunk per stage): the bubble is larger than predicted"
        )
    notes += [
        f"stage {s.index} recomputes its layers in the backward ({s.recompute})"
        for s in plan.stages
        if s.recompute != "none"
    ]
    dtypes = sorted({str(x.dtype) for x in abstract.values()})
    if str(plan.training.get("dtype", "f32")) not in ("f32", "float32") and dtypes == ["float32"]:
        notes.append(  # search/program/jax_records.py records the gradients and their sync in the parameters' dtype
            f"the plan trains in {plan.training['dtype']}; this program applies no mixed precision: it computes "
            "and syncs gradients in the model's float32 parameters (the plan's collectives and memory say so)"
        )
    predicted = {f"stage{st.index}": fid.planned(st) for st in plan.stages}  # the plan's records, read
    return _source(plan, model_spec, layers, stage_of, specs, pins, notes, predicted, lay.pinned)


def _dict(name: str, rows: Sequence[str], comment: str = "") -> list[str]:
    note = f"  # {comment}" if comment else ""
    if not rows:
        return [f"{name} = {{}}{note}"]
    return [f"{name} = {{{note}", *[f"    {r}" for r in rows], "}"]


def _source(
    plan: Plan,
    model_spec: str,
    layers: Sequence[str],
    stage_of: Mapping[str, int],
    specs: Mapping[str, Any],
    pins: Mapping[str, Any],
    notes: Sequence[str],
    predicted: Mapping[str, Any],
    pinned: set[int],
) -> str:
    st0 = plan.stages[0]
    per_mb = sum(shares(st0, plan.micro_batch_size))
    gb = per_mb * plan.num_micro_batches
    seq = int(plan.training.get("seq_len", 0))
    kind = "spmd" if plan.num_stages == 1 else ("gpipe" if plan.schedule == "gpipe" else "1f1b")
    if plan.chunked:  # model chunks: the interleaved list of every rank group's chunks
        kind = plan.schedule
    lines = [
        f'"""Partita-generated JAX program: {plan.model.get("name", model_spec)} on {plan.cluster.get("name", "?")}.',
        "",
        f"{plan.num_stages} stage(s), schedule {plan.schedule}, {plan.num_micro_batches} micro-batches of {per_mb} "
        f"samples (global batch {gb}), optimizer {plan.training.get('optimizer', 'adam')}.",
        f"Run:  JAX_NUM_CPU_DEVICES={plan.world_size} python program_jax.py --steps 3 [--reference] [--json-out F]",
        "      (or `partita run DIR --steps 3 --reference --json`).",
        "Everything below is the plan as data; partita/backends/jax/train.py builds the meshes and the",
        "jitted steps from it (its docstring says how each decision becomes JAX).",
        '"""',
        "",
        "import optax",
        "from jax.sharding import PartitionSpec as P",
        "",
        "from partita.backends.jax import train as jax_train",
        "",
        f"MODEL = {_q(model_spec)}",
        f"SEQ_LEN = {seq}",
        f"GLOBAL_BATCH = {gb}",
        f"NUM_MICRO_BATCHES = {plan.num_micro_batches}",
        f"LAYERS = {json.dumps(list(layers))}",
        "",
        "",
        "def make_optimizer() -> optax.GradientTransformation:",
        f"    return {_optimizer_src(plan.training)}",
        "",
        "",
        "# One mesh per stage, axes (dp, tp): coordinate (i, j) is rank ranks[i * tp + j]. shares: samples of",
        "# each micro-batch per dp replica. input_spec: the stage-boundary activation layout (batch dim first);",
        "# pin_layer_boundaries: every layer's inputs and outputs too (the search's convention, when the plan's",
        "# op strategies are known), else only module outputs with known layouts are pinned on tp.",
        "STAGES = [",
    ]
    for st in plan.stages:
        in_spec = jp.partition_spec(st.input_placement, (per_mb * st.tp,) * 4, st.mesh_shape, "input")
        lines += [
            "    dict(",
            f"        index={st.index}, ranks={list(st.ranks)}, dp={st.dp}, tp={st.tp}, zero_stage={st.zero_stage},",
            f"        recompute={_q(st.recompute)}, shares={list(shares(st, plan.micro_batch_size))},",
            f"        pin_layer_boundaries={st.index in pinned},",
            f"        layers={json.dumps(list(st.layers))},",
            f"        input_spec={_spec_src(in_spec)},  # plan: {placements_to_str(st.input_placement)}",
        ]
        if st.tp_shards_nothing:  # plan.json's stage field (issue 31): said here and checked at set-up
            lines += [
                f"        # plan.json: tp_shards_nothing. The plan places nothing of this stage on tp: each of the {st.tp}",
                "        # tp ranks holds and computes the whole stage on the same batch (no tp collectives).",
                "        tp_shards_nothing=True,",
            ]
        lines.append("    ),")
    lines += [
        "]",
        "",
        "# Parameter layouts on their stage's mesh (ZeRO-3 adds dp here) and optimizer-state layouts (ZeRO-1/2/3",
        "# shard them over dp; gradients are reduce-scattered into them, the updated parameters all-gathered).",
        *_dict(
            "PARAM_SPECS", [f"{_q(f)}: {_spec_src(specs[f][0])},  # stage {stage_of[f]} {specs[f][2]}" for f in specs]
        ),
        *_dict(
            "OPT_STATE_SPECS",
            [f"{_q(f)}: {_spec_src(specs[f][1])}," for f in specs if specs[f][1] != specs[f][0]],
            "where they differ from PARAM_SPECS",
        ),
        "",
        "# Tensor-parallel stages: layouts pinned on each output of these modules, in order (the layout",
        "# the producing op leaves, then the one its readers need: the plan's resharding collective).",
        *_dict(
            "ACTIVATION_PINS",
            [
                f"{_q(m)}: [{', '.join('[' + ', '.join(map(_spec_src, out)) + ']' for out in v)}],"
                for m, v in pins.items()
            ],
        ),
    ]
    if plan.num_stages > 1:
        chunks = chunks_per_rank(plan.schedule, plan.num_virtual_stages) if plan.chunked else 1
        actions = jp.pipeline_schedule(kind, plan.num_stages, plan.num_micro_batches, chunks)
        lines += [
            "",
            f"# {kind} dispatch order (action, stage, micro-batch): each stage's action list from",
            "# search/schedule.pipeline_actions (the list the cost model simulates), merged in dependency",
            "# order; each device runs its work in this order. 'F' forward, 'B' backward (the last stage's",
            "# 'B' starts from the loss).",
            "# fmt: off",
            "SCHEDULE = [",
            *[
                "    " + " ".join(f"({_q(a)}, {s}, {mb})," for a, s, mb in actions[i : i + 6])
                for i in range(0, len(actions), 6)
            ],
            "]",
            "# fmt: on",
        ]
    lines += [
        "",
        "# Where this program departs from the plan (printed at start-up and kept in the result).",
        *(["NOTES = ["] + [f"    {_q(n)}," for n in notes] + ["]"] if notes else ["NOTES = []"]),
        "",
        "# The plan's collectives per stage and step (its records, search/program/jax_records.py, by kind@axis);",
        "# the run compares them with the compiled HLO.",
        "PREDICTED_COLLECTIVES = {",
    ]
    for stage, kinds in predicted.items():
        rows = [
            f'{_q(k)}: {{"ops": {e["ops"]}, "bytes": {e["bytes"]!r}, "why": {json.dumps(e["why"])}}},'
            for k, e in kinds.items()
        ]
        lines += [
            f"    {_q(stage)}: {{" + ("" if rows else "},"),
            *[f"        {r}" for r in rows],
            *(["    },"] if rows else []),
        ]
    lines += [
        "}",
        "",
        "PROGRAM = jax_train.Program(",
        "    model=MODEL,",
        "    seq_len=SEQ_LEN,",
        "    global_batch=GLOBAL_BATCH,",
        "    num_micro_batches=NUM_MICRO_BATCHES,",
        "    layers=LAYERS,",
        "    stages=STAGES,",
        "    param_specs=PARAM_SPECS,",
        "    opt_state_specs=OPT_STATE_SPECS,",
        "    make_optimizer=make_optimizer,",
        "    activation_pins=ACTIVATION_PINS,",
        *(["    schedule=SCHEDULE,"] if plan.num_stages > 1 else []),
        "    notes=NOTES,",
        "    predicted_collectives=PREDICTED_COLLECTIVES,",
        ")",
        "",
        'if __name__ == "__main__":',
        "    jax_train.main(PROGRAM)",
    ]
    return "\n".join(lines) + "\n"
