"""Megatron sequence parallelism on a hand-made layout's Plan: the roles, records and memory the torch program has.

Called by ``search/entry/hand_plan.py`` (``partita compile MODEL --tp T ... --sequence-parallel``) on the Plan
``build_plan`` wrote for the same layout without sequence parallelism; imports only the plan, the IR and
the records' helpers (no torch). What the program does is ``backends/torch/tp.py``'s (module docstring,
roles ``colwise_sp``, ``rowwise_sp``, ``sequence_parallel``); this module writes it into the Plan so the
program carries it literally and every record stays the one prediction:

* ``Stage.tp_plan``: inside each block, ``colwise`` -> ``colwise_sp`` and ``rowwise`` -> ``rowwise_sp``;
  each block module gets ``sequence_parallel``;
* ``Stage.collectives`` (per step, bytes of the full tensor): each row module's forward all-reduce of
  ``b*s*h`` becomes a reduce-scatter, with an all-gather of its gradient backward; each column parent's
  backward all-reduce of its input gradient becomes a reduce-scatter, with an all-gather of its
  input forward (Korthikanti et al. 2022, sec. 4.2.2: ``g`` / ``g-bar``); the region's ends: the
  first block's input gradient and the last block's output are all-gathered (in the residual
  stream's dtype: f32 under autocast on the first stage, the received activation's dtype on later
  ones, the training dtype under FSDP2); without recompute each column parent's input is all-gathered
  once more in the backward (its saved copy is this rank's rows, ``backends/torch/regather.py``, as in
  Megatron-LM; recorded but not timed, like the region's ends below: Megatron overlaps it with the
  input-gradient GEMM, this program runs it when the first column module's backward needs it); each
  plain parameter inside the blocks (the norms' weights) has its gradient (f32; FSDP2's unsharded one in the training dtype) all-reduced over tp once per
  micro-batch;
* ``Stage.predicted["memory_by_category"]["activations"]`` (and ``memory_bytes``): the saved
  activations of the block region that the program now keeps for ``s/t`` rows (:func:`_memory`, by
  ``search/layer/saved.py``'s rules for the tensors the tp-replicated ops save). Times stay the layout's
  without sequence parallelism: on a ring an all-reduce costs a reduce-scatter plus an all-gather; the
  region's two boundary all-gathers, the backward re-gathers and the norms' small all-reduces are
  recorded but not timed.

Not built (refused by :func:`check`, with the reason): model chunks (interleaved 1F1B, ZB-V) and split
backwards (zero-bubble), full recompute, and blocks whose tp modules are not Megatron column / row pairs
(or whose attention lies outside a column module's parent).
Sequence parallelism is no dimension of the search (``search/entry/planner.py``): only this what-if path builds
it. Searching it would need its memory and records per (layer kind, tp) inside ``stage_cost``'s arrays,
priced before the inter-op DP compares layouts, and the refusals above carved out of the search space;
this pass only rewrites one finished layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from partita.errors import ConfigError
from partita.ir import Graph, Role
from partita.plan import Collective, Plan, Stage
from partita.search.program import records

_SP_ROLE = {"colwise": "colwise_sp", "rowwise": "rowwise_sp"}


def check(
    *,
    tp: int | Sequence[int],
    dp: int,
    zero_stage: int,
    recompute: str,
    schedule: str,
    num_virtual: int,
    cp: int = 1,
    program: str = "torch",
) -> None:
    """Refuse what the runtime does not build with sequence parallelism (module docstring); ``dp`` and
    ``zero_stage`` are any (FSDP2 stages included). ``tp``: one degree, or one per stage (refused
    unless all equal: this pass rewrites stages of one layout). ``cp > 1``: context parallelism, whose
    records with sequence parallelism are not written (refused). ``program="megatron"``: the layout is
    priced as Megatron-LM's program (``evaluate_config(tp_style="megatron")``, the benches' published
    rows), which builds sequence parallelism with model chunks (interleaved 1F1B) and with context
    parallelism (Llama 3 405B ran tp8 cp16 pp16 with it): only the schedule and cp refusals are lifted,
    ``partita compile`` and ``partita evaluate`` of a Partita program keep them."""
    why, fix = "", ""
    megatron = program == "megatron"
    if not isinstance(tp, int) and len(set(tp)) > 1:
        why = f"it is built for one tensor-parallel degree on every stage, and the stages have {','.join(map(str, tp))}"
        fix = "give one --tp for all stages, or drop --sequence-parallel"
    elif min([tp] if isinstance(tp, int) else tp) < 2:
        why, fix = "it splits the sequence over tp, and tp=1", "pass --tp 2 or more, or drop --sequence-parallel"
    elif recompute == "full":
        why = "full recompute would run each block's all-gathers and reduce-scatters again, which is not priced"
        fix = "use --recompute selective (collective outputs are kept) or none"
    elif (schedule not in ("gpipe", "1f1b") or num_virtual > 1) and not (megatron and schedule == "interleaved_1f1b"):
        why = f"the {schedule} schedule (model chunks or a split backward) is not built with it"
        fix = "use --schedule 1f1b or gpipe"
    elif cp > 1 and not megatron:
        why = f"with context parallelism (cp={cp}) it has no Plan layout yet: the records of the two are not written"
        fix = "drop --sequence-parallel with --cp"
    if why:
        raise ConfigError(f"sequence parallelism cannot be built here: {why}.", f"{fix}.")


def check_strategies(graph: Graph, blocks: Sequence[str], strategy: dict[str, str]) -> None:
    """:func:`_check_blocks` by the layer ILP's strategies (``partita evaluate``, which has no tp plan):
    each block needs a column and a row matmul over tp, else ConfigError with the same words."""
    index = {lay.name: lay for lay in graph.layers}
    for b in blocks:
        roles = {_role(strategy.get(n, "")) for n in index[b].nodes}
        if {"col", "row"} <= roles:
            continue
        raise ConfigError(
            f"sequence parallelism needs each block's attention and MLP split over tp as Megatron column / row "
            f"pairs, and this layout does not split {b} that way: its attention would see only this rank's rows.",
            "drop --sequence-parallel, or use a layout whose tp splits the blocks (a larger model, micro-batch or "
            "sequence makes the layer ILP split them).",
        )


def _in_block(path: str, blocks: Sequence[str]) -> str | None:
    return next((b for b in blocks if path == b or path.startswith(b + ".")), None)


def _module_of(reason: str) -> str:
    """The module a tp record names: ``rowwise M`` or ``tp input grad of X <- M (column-parallel)``."""
    if "<- " in reason:
        return reason.split("<- ", 1)[1].split(" (", 1)[0]
    return reason.split(" ", 1)[1] if " " in reason else ""


def apply(plan: Plan, graph: Graph) -> Plan:
    """``plan`` with sequence parallelism on every stage of tp > 1 (module docstring)."""
    stages = tuple(_stage(plan, graph, i) for i in range(len(plan.stages)))
    search = {**plan.search, "sequence_parallel": True}
    predicted = dict(plan.predicted)
    per_device = dict(predicted.get("memory_per_device", {}))
    for st in stages:  # the plan's per-device memory: each stage's, as build_plan keys it
        for key in [k for k in per_device if k.startswith(f"stage{st.index}:")]:
            per_device[key] = st.predicted.get("memory_bytes", per_device[key])
    if per_device:
        predicted["memory_per_device"] = per_device
    return dataclasses.replace(plan, stages=stages, search=search, predicted=predicted)


def _stage(plan: Plan, graph: Graph, i: int) -> Stage:
    s = plan.stages[i]
    blocks = [n for n in s.layers if n not in records.NOT_BLOCKS]
    if s.tp < 2 or not blocks:
        return s
    roles = dict(s.tp_plan)
    for path, role in s.tp_plan.items():
        if _in_block(path, blocks) is None:
            continue
        if role not in _SP_ROLE:
            raise ConfigError(
                f"sequence parallelism needs Megatron column / row pairs in each block, and {path} is {role!r}.",
                "drop --sequence-parallel for this model.",
            )
        roles[path] = _SP_ROLE[role]
    _check_blocks(graph, blocks, s.tp_plan)
    _check_gathered_inputs(graph, blocks, s.tp_plan)
    roles.update({b: "sequence_parallel" for b in blocks})
    facts = records.GraphFacts(graph)
    m, seq = plan.num_micro_batches, int(plan.training.get("seq_len", 1))
    lo, hi = records._ranges(plan, s)[0]
    # the residual stream's dtype: f32 from the embedding under autocast (f32 master weights); a later
    # stage's blocks add to the activation received from the stage before, sent in the training dtype;
    # under FSDP2's MixedPrecisionPolicy everything runs in it, the norms' unsharded weights too
    fsdp = s.dp > 1 and s.zero_stage >= 1
    low = records.compute_bytes(plan.training)
    residual = records.F32 if i == 0 and not fsdp else low
    grad_item = low if fsdp else records.F32
    out: list[Collective] = []
    for c in s.collectives:
        where = _in_block(_module_of(c.reason), blocks) if c.axis == "tp" and c.kind == "all_reduce" else None
        if where is None or c.phase == "optimizer":
            out.append(c)
            continue
        other = "backward" if c.phase == "forward" else "forward"
        out.append(dataclasses.replace(c, kind="reduce_scatter", reason=f"sequence parallel: {c.reason}"))
        out.append(dataclasses.replace(c, kind="all_gather", phase=other, reason=f"sequence parallel: {c.reason}"))
        if c.phase == "backward" and s.recompute == "none":  # a column parent's input, gathered again
            why = f"sequence parallel: re-gather for backward ({c.reason})"
            out.append(dataclasses.replace(c, kind="all_gather", phase="backward", reason=why))
    rows = (hi - lo) * facts.boundary_elems(blocks[-1], seq) * residual
    out.append(Collective("all_gather", "tp", rows, m, "forward", "sequence parallel: last block's output"))
    out.append(Collective("all_gather", "tp", rows, m, "backward", "sequence parallel: first block's input gradient"))
    for t, fqn in _plain_params(graph, blocks, roles):
        n = records._numel(graph, t)
        out.append(Collective("all_reduce", "tp", grad_item * n, m, "backward", f"sequence parallel: {fqn} grad"))
    predicted = _memory(plan, graph, s, blocks, (hi - lo, seq))
    return dataclasses.replace(s, tp_plan=roles, collectives=tuple(out), predicted=predicted)


def _check_blocks(graph: Graph, blocks: Sequence[str], tp_plan: Any) -> None:
    """Every op outside the column modules' parents runs on this rank's rows: each block needs a
    column / row pair, and its attention inside a column parent (which gathers the whole sequence)."""
    from partita.ir import Prim

    index = {lay.name: lay for lay in graph.layers}
    for b in blocks:
        mine = {p: r for p, r in tp_plan.items() if _in_block(p, [b])}
        parents = [p.rpartition(".")[0] for p, r in mine.items() if r == "colwise"]
        attention = [graph.node(n).module for n in index[b].nodes if graph.node(n).prim is Prim.ATTENTION]
        if "rowwise" in mine.values() and parents and all(_in_block(a, parents) for a in attention):
            continue
        raise ConfigError(
            f"sequence parallelism needs each block's attention and MLP split over tp as Megatron column / row "
            f"pairs, and this layout splits {b} as {sorted(set(mine.values())) or 'nothing (replicated)'}: its "
            "attention would see only this rank's rows.",
            "drop --sequence-parallel, or use a layout whose tp splits the blocks (a larger model, micro-batch or "
            "sequence makes the layer ILP split them).",
        )


def _check_gathered_inputs(graph: Graph, blocks: Sequence[str], tp_plan: Any) -> None:
    """The runtime gathers each column parent's hidden states once, as a Replicate DTensor that only its
    column modules read (``backends/torch/tp.py``, ``_gather_rows``). So under sequence parallelism every column
    module of a parent reads those hidden states (a tensor made outside the parent), and nothing else in the
    parent reads them. DeepSeek-V3's MLA breaks both: its low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa`` (plain,
    replicated) read the hidden states and its column ``q_b_proj`` / ``kv_b_proj`` read their outputs; the program
    died inside torch ("mixed torch.Tensor and DTensor"). ConfigError naming the module, before anything runs."""
    made_by = {t: n.module for n in graph.nodes for t in n.outputs}
    params = {t for t, ten in graph.tensors.items() if ten.role in (Role.PARAMETER, Role.BUFFER)}
    index = {lay.name: lay for lay in graph.layers}
    for b in blocks:
        columns = [p for p, r in tp_plan.items() if r == "colwise" and _in_block(p, [b])]
        for parent in sorted({c.rpartition(".")[0] for c in columns}):
            mine = [c for c in columns if c.rpartition(".")[0] == parent]
            nodes = [graph.node(n) for n in index[b].nodes if _in_block(graph.node(n).module, [parent])]

            def outside(t: str, parent: str = parent) -> bool:
                return t not in params and _in_block(made_by.get(t, ""), [parent]) is None

            hidden = {t for n in nodes if _in_block(n.module, mine) for t in n.inputs if outside(t)}
            bad = [c for c in mine if not any(_in_block(n.module, [c]) and set(n.inputs) & hidden for n in nodes)]
            bad += sorted({n.module for n in nodes if not _in_block(n.module, mine) and set(n.inputs) & hidden})
            if bad or not hidden:
                raise ConfigError(
                    f"sequence parallelism gathers the hidden states of {parent} once, for its column-parallel "
                    f"modules alone, and in this model {bad[0] if bad else parent} does not fit that: each column "
                    "module must read those hidden states, and no other module of the parent may (DeepSeek-V3's "
                    "low-rank attention projects them with plain q_a_proj / kv_a_proj_with_mqa first).",
                    "drop --sequence-parallel for this model (tensor parallelism alone splits its heads).",
                )


def _memory(plan: Plan, graph: Graph, s: Stage, blocks: Sequence[str], size: tuple[int, int]) -> dict[str, Any]:
    """``s.predicted`` with the activations the blocks keep for ``s/t`` rows (:func:`activation_delta`)
    times the micro-batches in flight. Times per the non-SP layout's (an all-reduce is priced as a
    reduce-scatter plus an all-gather)."""
    from partita.ir import DTYPE_BYTES

    low = DTYPE_BYTES.get(str(plan.training.get("dtype", "f32")), 4)
    fsdp = s.dp > 1 and s.zero_stage >= 1
    delta = activation_delta(graph, blocks, dict(s.op_strategies), s.tp, s.recompute, low, fsdp, size)
    pred: dict[str, Any] = dict(s.predicted)
    cats: dict[str, float] = dict(pred.get("memory_by_category", {}))
    flight = float(pred.get("in_flight", 1.0))
    if "activations" in cats:
        cats["activations"] = cats["activations"] + delta * flight
        pred["memory_by_category"] = cats
    if "memory_bytes" in pred:
        pred["memory_bytes"] = pred["memory_bytes"] + delta * flight
    return pred


def activation_delta(
    graph: Graph,
    blocks: Sequence[str],
    strategy: dict[str, str],
    t: int,
    recompute: str,
    low: int,
    fsdp: bool,
    size: tuple[int, int],
    regather: bool = False,
) -> float:
    """Bytes per micro-batch that sequence parallelism changes in the saved activations of ``blocks``
    (negative: saved), given each op's tp strategy (``strategy``: node -> the layer ILP's choice, a
    column matmul ``n@tp`` / ``...:colwise``, a row matmul ``k@tp`` / ``...:rowwise``), ``low`` the
    training dtype's bytes, ``fsdp`` whether FSDP2's MixedPrecisionPolicy runs the stage
    (``search/layer/saved.py``'s "low" mode) and ``size`` = (micro-batch rows, sequence). One function
    for the Plan (:func:`_memory`) and ``partita evaluate`` (``search/entry/evaluate.py``):

    * no recompute: every saved tensor the tp-replicated ops of a block count (``saved.replicated_bytes``:
      the norms' inputs and outputs, the block input) is kept for this rank's rows, and so is each column
      group's input, which the program all-gathers again in the backward (``backends/torch/regather.py``,
      as Megatron-LM's column layer does);
    * selective recompute: of what the policy keeps (block input, matmul and collective outputs), the
      block input and each row module's collective output are this rank's rows, and each column
      group's all-gathered input (a collective output) is kept whole in the training dtype; with
      ``regather`` (Megatron-LM's program: its column layer saves its input's ``s/t`` rows and all-gathers
      them again in the backward, Korthikanti et al. 2022 sec. 4.2.3) that input is kept for ``s/t`` rows too."""
    from partita.search.layer.layer_strategies import needs_grad
    from partita.search.layer.saved import replicated_bytes, saved_plan

    rows, seq = size
    mode = "f32" if low >= 4 else "low" if fsdp else "autocast"
    grad, env = needs_grad(graph), {"B": rows, "S": seq}
    index = {lay.name: lay for lay in graph.layers}
    facts = records.GraphFacts(graph)
    delta = 0.0
    for name in blocks:
        lay = index[name]
        elems = rows * facts.boundary_elems(name, seq)  # b*s*h: the block input, a row output, a column input
        # each column group's gathered input, once (q/k/v or gate/up read one normed tensor)
        parents = {_activation_input(graph, n) for n in lay.nodes if _role(strategy.get(n, "")) == "col"}
        if recompute == "none":
            sp = saved_plan(graph, lay, mode, low, grad)
            kept = frozenset(n for n in lay.nodes if strategy.get(n, "R") == "R")
            delta -= (1 - 1 / t) * replicated_bytes(graph, lay, sp, kept, env)
            # the column inputs, kept for s/t rows and all-gathered again in the backward (both programs:
            # backends/torch/regather.py, Megatron-LM's column layer), in the training dtype
            delta -= (1 - 1 / t) * elems * low * len(parents)
            continue
        num_rows = sum(1 for n in lay.nodes if _role(strategy.get(n, "")) == "row")
        delta -= (1 - 1 / t) * elems * (low if fsdp else records.F32)  # the block input (the residual stream)
        delta -= (1 - 1 / t) * elems * low * num_rows  # each row output: reduce-scattered
        delta += elems * low * len(parents) / (t if regather else 1)  # each column group's gathered input
    return delta


def _activation_input(graph: Graph, node: str) -> str:
    """A matmul's activation operand (the input that is no parameter)."""
    n = graph.node(node)
    return next((x for x in n.inputs if graph.tensors[x].role is not Role.PARAMETER), n.inputs[0])


def _role(strategy: str) -> str:
    """``col`` / ``row`` for a tp-split matmul's strategy (the torch program's roles, or Megatron's
    output / reduction split), else ``""``."""
    if strategy.endswith(":colwise") or strategy == "n@tp":
        return "col"
    if strategy.endswith(":rowwise") or strategy == "k@tp":
        return "row"
    return ""


def _plain_params(graph: Graph, blocks: Sequence[str], roles: dict[str, str]) -> list[tuple[str, str]]:
    """(tensor, fqn) of the parameters inside ``blocks`` that no tp module holds (the norms' weights)."""
    tp_modules = [p for p, r in roles.items() if r != "sequence_parallel"]
    out = []
    for t, ten in graph.tensors.items():
        fqn = ten.fqn or ""
        if ten.role is not Role.PARAMETER or _in_block(fqn, blocks) is None:
            continue
        if _in_block(fqn.rpartition(".")[0], tp_modules) is None:
            out.append((t, fqn))
    return sorted(out, key=lambda x: x[1])
