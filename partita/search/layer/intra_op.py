"""Intra-operator sharding search for one layer on one logical mesh (after Alpa).

Sits between the annotated IR and the inter-op search (``search/pipeline/inter_op.py``), which calls
:func:`solve_layer` (through ``search/layer/memo.py``) for every (layer kind, device type, submesh,
micro-batch) it considers and reads the :class:`LayerSolution`.

Formulation. Vertices ``v`` are groups of IR nodes (a leader and its *followers*: elementwise /
view ops whose only activation input comes from a node of the group take the layout it produces,
as in Alpa); ``S_v`` their strategy lists (``search/layer/strategies.py``), pruned of dominated entries
(same layouts at every edge leaving the group, no cheaper and no smaller alternative). Edges
``(u, v)`` exist where a tensor produced in ``u`` is read in ``v``::

    s_v in {0,1}^|S_v|,  sum_i s_v,i = 1                                  (one strategy per vertex)
    e_uv in [0,1]^{|S_u| x |S_v|},  sum_j e_uv,ij = s_u,i,  sum_i e_uv,ij = s_v,j   (e = s_u s_v^T)
    minimise  sum_v c_v . s_v  +  sum_(u,v) <R_uv, e_uv>
    s.t.      sum_v m_v . s_v  <=  memory_budget

* ``c_v,i`` = forward compute (roofline, ``search/pricing/cost_model.py``) + backward compute (2x for
  matmul/attention/conv, 1x otherwise) + the op's own collectives (vocab-parallel loss) + the
  boundary resharding of layer inputs/outputs + gradient sync of the vertex's parameters: an
  all-reduce over every axis on which a parameter's gradient is partial (the parameter is
  replicated along an axis that shards another label, e.g. the batch = data parallelism);
* ``R_uv,ij`` = forward resharding of each tensor from ``u``'s output layout to ``v``'s input layout
  plus backward resharding of its gradient from the layout ``v``'s backward produces to the one
  ``u``'s backward needs (``search/layer/reshard.py``): column-parallel input grads become all-reduces,
  forward all-gathers become reduce-scatters, and so on;
* ``m_v,i`` = parameter + gradient + optimizer-state shards of the vertex's parameters + the
  activations its nodes save for backward (producer layout).

Tensors that need no gradient (no parameter upstream: masks, rotary tables) have no backward
resharding. ``tp_style="torch"`` (torch graphs) keeps the search to the programs the torch runtime
builds: on the ``tp`` axis each op has only ``strategies.torch_tp_strategies``' choices (module roles
for linears and embeddings, local ops on a kept label elsewhere), and an edge or layer boundary that
would reshard on ``tp`` costs ``FORBIDDEN`` (the runtime issues no collective between ops), except a
column module's partial input gradient, which its Replicate input DTensor all-reduces (one per
parent module and tensor); the solution's ``tp_plan`` is the program's ``roles``.

Solved exactly by ``search/layer/ilp.py``: a tree DP when the vertex graph is a forest (chains), else
OR-Tools HiGHS. Times are per micro-batch; gradient sync is counted once (weight 1) in the
objective but reported separately so the inter-op search can overlap or amortise it.

Conventions. ``env["B"]`` is the micro-batch seen by the *whole mesh* (per-replica micro-batch x
data-parallel degree), ``env["S"]`` the sequence length. ``boundary`` gives one placement per mesh
axis for every activation entering or leaving the layer (default: ``S(0)`` on the axis named
``dp``, ``R`` elsewhere). ``memory_budget=None`` means the device's memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import sympy

from partita.errors import ConfigError, InfeasibleError
from partita.ir import DTYPE_BYTES, Graph, Layer, Node, Prim, Role, dim_size, label_sizes
from partita.passes.annotate import VIEW_PRIMS
from partita.plan import Collective
from partita.search.layer import ilp
from partita.search.layer.ilp import IlpStats
from partita.search.layer.layer_strategies import TP_STYLES, needs_grad, saved_plan_of, strategies_of
from partita.search.layer.program_traits import program_fusion, program_width
from partita.search.layer.reshard import Layout, grad_requirement, reshard_steps, shard_dim, shard_factor
from partita.search.layer.saved import SavedPlan, freed_at_b, stacked_low_grad
from partita.search.layer.strategies import Strategy, linear_operands, routed_rows
from partita.search.pricing import fp8, gemm
from partita.search.pricing.cost_model import CostModel, program_state_bytes
from partita.search.pricing.mesh import LogicalMesh

FOLLOWER_PRIMS = (Prim.ELEMENTWISE, Prim.RESHAPE, Prim.PERMUTE, Prim.DROPOUT, Prim.EXPAND, Prim.SPLIT, Prim.SLICE)


@dataclasses.dataclass(frozen=True)
class LayerSolution:
    layer_kind: str
    device_type: str
    mesh_shape: tuple[int, ...]
    env: Mapping[str, int]
    forward_time_s: float
    backward_time_s: float
    compute_time_s: float
    comm_time_s: float
    grad_sync_bytes: float
    grad_sync_time_s: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    boundary_bytes: float
    param_placements: Mapping[str, tuple[str, ...]]
    op_strategies: Mapping[str, str]
    collectives: tuple[Collective, ...]
    stats: IlpStats
    boundary: tuple[str, ...] = ()
    tp_plan: Mapping[str, str] = dataclasses.field(default_factory=dict)  # module path -> torch tp role (torch)
    selective_keep_bytes: float = 0.0  # saved bytes under selective recompute (matmul + collective outputs)
    selective_forward_s: float = 0.0  # forward compute selective recompute runs again (non-matmul ops)
    # the same two in the program's other precision mode (search/layer/saved.py: ``modes[1]``; torch bf16/f16:
    # ``activation_bytes`` is the FSDP2 MixedPrecisionPolicy program, these the torch.autocast one)
    modes: tuple[str, ...] = ()
    activation_bytes_alt: float | None = None
    selective_keep_bytes_alt: float | None = None
    transient_bytes: float = 0.0  # allocated during the backward on top of the saved bytes (the loss, fp8 casts)
    # a split backward (zero bubble): the output gradients B captures and W reads, per micro-batch, in the
    # program's dtype and this solution's layouts (_LayerProblem.held_bytes); _alt: the other precision mode
    w_held_bytes: float = 0.0
    w_held_bytes_alt: float | None = None
    # parameter gradients a backward materializes beside .grad (_LayerProblem.grad_transient): in one
    # backward pass, and in a deferred W of one split node (zero bubble); not scaled by the micro-batch
    grad_transient_bytes: float = 0.0
    w_grad_transient_bytes: float = 0.0

    @property
    def memory_bytes(self) -> float:
        """Per device, one micro-batch of saved activations, no ZeRO."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def step_time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s


@dataclasses.dataclass
class _Costs:
    """Per (node, strategy) numbers and the collectives behind them."""

    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    fwd_comm: float = 0.0
    bwd_comm: float = 0.0
    grad_sync: float = 0.0
    grad_sync_bytes: float = 0.0
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    opt_bytes: float = 0.0
    act_bytes: float = 0.0
    forbidden: float = 0.0  # FORBIDDEN per tp transition the torch runtime cannot build (tp_style torch)
    # selective recompute as the torch runtime runs it (backends/torch/parallel._save_matmuls): matmul
    # outputs and tp collectives' outputs are kept, every other op's forward runs again in the backward
    sel_keep: float = 0.0
    sel_fwd: float = 0.0
    act_alt: float = 0.0  # act_bytes / sel_keep in the second precision mode (not in the ILP's memory)
    transient: float = 0.0  # bytes a backward allocates on top of the saved ones (the loss, below)
    held: float = 0.0  # output gradient bytes a deferred W reads (_LayerProblem.held_bytes)
    held_alt: float = 0.0
    grad_transient: float = 0.0  # _LayerProblem.grad_transient: summed over a layer's nodes
    w_grad_transient: float = 0.0  # ... the largest node's (one split node's W at a time)
    fp8_transient: float = 0.0  # a Float8Linear's backward casts (fp8.backward_transient): the largest node's
    sel_keep_alt: float = 0.0
    colls: list[tuple[str, int, float, str, str]] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> float:
        return self.fwd_compute + self.bwd_compute + self.fwd_comm + self.bwd_comm + self.grad_sync + self.forbidden

    @property
    def memory(self) -> float:
        return self.param_bytes + self.grad_bytes + self.opt_bytes + self.act_bytes


class _LayerProblem:
    """Evaluates sizes, enumerates and prices strategies, groups followers, builds the ILP."""

    def __init__(
        self,
        graph: Graph,
        layer: Layer,
        mesh: LogicalMesh,
        env: Mapping[str, int],
        dtype: str,
        optimizer: str,
        cm: CostModel,
        boundary: tuple[str, ...],
        tp_style: str = "auto",
    ) -> None:
        self.g, self.layer, self.mesh, self.env, self.dtype, self.cm = graph, layer, mesh, env, dtype, cm
        self.boundary = boundary
        self.fusion, self.width = program_fusion(graph, tp_style, cm), program_width(graph, tp_style, dtype)
        torch = graph.meta.get("framework") == "torch"  # a traced torch model (not JAX, not a test IR)
        self.state_bytes = program_state_bytes(graph, dtype, optimizer)  # as the graph's program keeps them
        self.nodes = [graph.node(n) for n in layer.nodes]
        self.producer = {o: n for n in self.nodes for o in n.outputs}
        self.consumers: dict[str, list[Node]] = {}
        for n in self.nodes:
            for t in n.inputs:
                self.consumers.setdefault(t, []).append(n)
        self.freed_at_b = freed_at_b(graph, self.nodes, self.consumers, self._base)  # the loss's nodes
        self._ev: dict[sympy.Expr, int] = {}
        self._nb: dict[str, float] = {}
        self._rs: dict[tuple[Layout, Layout, float], tuple[float, tuple]] = {}
        self.outputs = set(layer.outputs)
        self.needs_grad = needs_grad(graph)
        # saved activations as the program holds them (search/layer/saved.py); JAX keeps the traced rule (_saves)
        low = DTYPE_BYTES.get(dtype, 4)
        self.modes: tuple[str, ...] = () if not torch else ("f32",) if low >= 4 else ("low", "autocast")
        f8 = fp8.saved_copies(mesh.device.kind) if cm.fp8 else None  # autocast's copies a Float8Linear keeps
        self.saved = [saved_plan_of(graph, layer, m, low, self.needs_grad, f8) for m in self.modes]
        self.first_column: dict[tuple[str, str], str] = {}  # (input root, parent module) -> its first reader
        for sp in self.saved[-1:]:
            for name in sp.copies:
                n = graph.node(name)
                for i in sp.copies[name]:
                    self.first_column.setdefault(
                        (sp.root.get(n.inputs[i], n.inputs[i]), n.module.rpartition(".")[0]), name
                    )
        # tp_style torch = the torch runtime's tensor parallelism (strategies.torch_tp_strategies): on the
        # tp axis only the module roles it builds, and no resharding between ops but the roles' own
        self.tp = mesh.axis_names.index("tp") if tp_style == "torch" and "tp" in mesh.axis_names else None
        self.shared_grad: dict[tuple[str, str], int] = {}  # (tensor, parent module) -> column modules reading it
        self.strategies: dict[str, list[Strategy]] = {}
        self.costs: dict[str, list[_Costs]] = {}
        first_use: set[str] = set()
        for n in self.nodes:
            exprs = label_sizes(n, graph)
            sizes = {c: self.ev(d) for c, d in exprs.items()}
            strats = strategies_of(graph, n, exprs, sizes, mesh, tp_style, self.tp is not None)
            if self.tp is not None:
                is_param = [graph.tensors[t].role is Role.PARAMETER for t in n.inputs]
                lin = linear_operands(n, is_param)
                if lin is not None:  # column modules of one parent reading one tensor share its grad all-reduce
                    key = (n.inputs[lin[0]], n.module.rpartition(".")[0])
                    self.shared_grad[key] = self.shared_grad.get(key, 0) + 1
            params = [t for t in n.inputs if graph.tensors[t].role is Role.PARAMETER and t not in first_use]
            first_use.update(params)
            self.strategies[n.name] = strats
            self.costs[n.name] = [self._price(n, s, sizes, params) for s in strats]

    # ---- evaluation helpers -----------------------------------------------------------------
    def ev(self, e: sympy.Expr | int) -> int:
        if isinstance(e, int):
            return e
        if e not in self._ev:
            self._ev[e] = dim_size(e, self.env)
        return self._ev[e]

    def nbytes(self, t: str) -> float:
        got = self._nb.get(t)  # asked once per strategy that reads t: evaluated once per problem
        if got is None:
            ten = self.g.tensors[t]
            item = self.width if self.width and ten.dtype == "f32" else ten.itemsize  # as the program moves it
            got = self._nb[t] = float(math.prod(self.ev(d) for d in ten.shape) * item)
        return got

    def reshard(self, src: Layout, dst: Layout, t: str) -> tuple[float, tuple]:
        """(seconds, steps) to move tensor ``t`` from ``src`` to ``dst``; cached."""
        key = (src, dst, self.nbytes(t))
        if key not in self._rs:
            if src == dst:
                self._rs[key] = (0.0, ())
            else:
                steps = tuple(reshard_steps(src, dst, key[2], self.mesh))
                cost = sum(self.cm.collective_time(s.kind, s.bytes, self.mesh.link(s.axis)) for s in steps)
                self._rs[key] = (cost, steps)
        return self._rs[key]

    def boundary_layout(self, t: str) -> Layout:
        ten = self.g.tensors[t]
        if ten.role is Role.BUFFER or ten.role is Role.PARAMETER:
            return ("R",) * self.mesh.ndim
        out = []
        for p, size in zip(self.boundary, self.mesh.shape):
            d = shard_dim(p)
            ok = d is not None and d < ten.rank and self.ev(ten.shape[d]) % size == 0
            out.append(p if ok or d is None else "R")
        return tuple(out)

    def _add_reshard(self, c: _Costs, src: Layout, dst: Layout, t: str, phase: str, why: str) -> None:
        cost, steps = self.reshard(src, dst, t)
        if phase == "forward":
            c.fwd_comm += cost
        else:
            c.bwd_comm += cost
        c.colls.extend((s.kind, s.axis, s.bytes, phase, why) for s in steps)

    # ---- pricing ------------------------------------------------------------------------------
    def _flops(self, n: Node, sizes: Mapping[str, int]) -> float:
        if n.flops != 0:
            return float(self.ev(n.flops))
        sig = n.sig
        if n.prim in (Prim.MATMUL, Prim.CONV):
            return 2.0 * math.prod(sizes[c] for c in sig.labels)
        if n.prim is Prim.ATTENTION:
            q, k, v = sig.inputs[:3]
            return 2.0 * math.prod(sizes[c] for c in set(q) | set(k)) + 2.0 * math.prod(
                sizes[c] for c in set(sig.outputs[0]) | set(v)
            )
        if n.prim in (Prim.NORM, Prim.SOFTMAX, Prim.CROSS_ENTROPY, Prim.BATCH_NORM):
            return 5.0 * math.prod(sizes[c] for c in sig.inputs[0])
        if n.prim in (Prim.ELEMENTWISE, Prim.REDUCE):
            return float(math.prod(sizes[c] for c in sig.labels))
        return 0.0

    def _price(self, n: Node, s: Strategy, sizes: Mapping[str, int], params: Sequence[str]) -> _Costs:
        c = _Costs()
        mesh, tensors = self.mesh, self.g.tensors
        flops = self._flops(n, sizes) / s.work_divisor
        fused = n.attrs.get("fused_io", ())  # fusable intermediates (passes/fusion.py)
        ios = [*zip(n.inputs, s.in_layouts), *zip(n.outputs, s.out_layouts)]
        nb = sum(self.nbytes(t) / shard_factor(lay, mesh) * (1.0 - self.fusion * (t in fused)) for t, lay in ios)
        nb = 0.0 if n.prim in VIEW_PRIMS else nb  # views move no data
        cm = self.cm
        if cm.fp8 and not any(tensors[t].role is Role.PARAMETER for t in n.inputs):
            cm = dataclasses.replace(cm, fp8=None)  # torchao converts nn.Linear only: a bmm (attention) stays bf16
        g = gemm.local_shape(n.sig, sizes, s.axis_labels, mesh.shape) if n.prim is Prim.MATMUL else None  # per device
        c.fwd_compute = cm.compute_time(n.prim, flops, nb, self.dtype, g) if flops or nb else 0.0
        c.bwd_compute = cm.backward_compute_time(n.prim, flops, nb, self.dtype, g) if flops or nb else 0.0
        if cm.fp8 and n.prim is Prim.MATMUL:  # a Float8Linear's backward casts
            el = {t: self.numel(t) / shard_factor(lay, mesh) for t, lay in ios}
            c.fp8_transient = fp8.linear_transient(n, tensors, el, DTYPE_BYTES[self.dtype])
        if n.prim is not Prim.MATMUL:
            c.sel_fwd = c.fwd_compute
        for oc in s.op_collectives:
            dt = self.cm.collective_time(oc.kind, oc.bytes, mesh.link(oc.axis))
            c.fwd_comm += dt if oc.phase == "forward" else 0.0
            c.bwd_comm += dt if oc.phase != "forward" else 0.0
            c.colls.append((oc.kind, oc.axis, oc.bytes, oc.phase, oc.reason))
        p_item, g_item, o_item = self.state_bytes
        for t, lay, glay in zip(n.inputs, s.in_layouts, s.in_grad_layouts):
            ten = tensors[t]
            if t in params:
                numel = math.prod(self.ev(d) for d in ten.shape) / shard_factor(lay, mesh)
                c.param_bytes += numel * p_item
                c.grad_bytes += numel * g_item
                c.opt_bytes += numel * o_item
                for i, gp in enumerate(glay):
                    if gp == "P":
                        t_sync = self.cm.collective_time("all_reduce", numel * g_item, mesh.link(i))
                        c.grad_sync += t_sync
                        c.grad_sync_bytes += numel * g_item
                        c.colls.append(("all_reduce", i, numel * g_item, "optimizer", f"gradient sync {ten.fqn or t}"))
            elif t not in self.producer and ten.role is not Role.PARAMETER:  # layer boundary input
                src = self.boundary_layout(t)
                self._add_reshard(c, src, lay, t, "forward", f"layer input {t} -> {n.name}")
                c.forbidden += self.tp_forbidden(src, lay)
                if ten.role is Role.ACTIVATION and t in self.needs_grad:
                    why = self.grad_reason(t, n, s, f"grad of layer input {t}")
                    self._add_reshard(c, glay, grad_requirement(src), t, "backward", why)
                    c.forbidden += self.tp_forbidden(glay, grad_requirement(src), s)
                if self._saves(n) and not self.saved:
                    c.act_bytes += self.nbytes(t) / shard_factor(lay, mesh)
        for t, lay in zip(n.outputs, s.out_layouts):
            saved = n.prim is Prim.ATTENTION or any(self._saves(m) for m in self.consumers.get(t, []))
            if saved and not self.saved:
                c.act_bytes += self.nbytes(t) / shard_factor(lay, mesh)
            if n.prim is Prim.MATMUL:  # its output, and the all-reduced copy of a partial one, stay saved
                reduced = "P" in lay or any(oc.phase == "forward" for oc in s.op_collectives)  # tp rowwise / gather
                keep = self.numel(t) / shard_factor(lay, mesh) * (2 if reduced else 1)
                items = [sp.item[t] for sp in self.saved] or [float(tensors[t].itemsize)]
                c.sel_keep += keep * items[0]
                c.sel_keep_alt += keep * items[-1]
            if t in self.outputs and tensors[t].rank > 0:  # every output that leaves the layer, every graph
                dst = self.boundary_layout(t)
                self._add_reshard(c, lay, dst, t, "forward", f"layer output {t} <- {n.name}")
                c.forbidden += self.tp_forbidden(lay, dst)
                if t in self.needs_grad:
                    self._add_reshard(c, dst, grad_requirement(lay), t, "backward", f"grad of layer output {t}")
        c.held, c.held_alt = self.held_bytes(n, s)
        c.grad_transient, c.w_grad_transient = self.grad_transient(n, s, c.grad_bytes)
        if self.saved:
            c.act_bytes, c.act_alt = (self._saved_bytes(sp, n, s) for sp in (self.saved[0], self.saved[-1]))
            if n.prim is Prim.CROSS_ENTROPY and n.inputs:
                # its backward: nll's dense f32 gradient and _log_softmax_backward_data's result (one kernel:
                # exp(output) is not kept apart), each the size of the (f32) logits, beside the saved
                # log-probabilities (issue 33: three priced one f32 logits over the rehearsed qwen2-1.5b row)
                c.transient = 2 * self.numel(n.inputs[0]) / shard_factor(s.in_layouts[0], mesh) * 4
        else:
            c.act_alt, c.sel_keep_alt = c.act_bytes, c.sel_keep
        if n.name in self.freed_at_b:  # their saved tensors die at B (saved.freed_at_b): held net of them
            c.held, c.held_alt = c.held - c.act_bytes, c.held_alt - c.act_alt
        return c

    def numel(self, t: str) -> float:
        return float(math.prod(self.ev(d) for d in self.g.tensors[t].shape))

    def _saved_bytes(self, sp: SavedPlan, n: Node, s: Strategy) -> float:
        """Bytes per device the program keeps for ``n``'s backward under ``s`` (``search/layer/saved.py``): the
        saved tensors ``n`` produces (or, for one produced before the layer, first reads), in their
        runtime dtype and ``s``'s layout (the pairs an expert-parallel rank keeps: ``strategies.routed_rows``),
        plus autocast's low copies of its inputs and weights."""
        mesh, total, (rows_in, rows_out, _) = self.mesh, 0.0, routed_rows(n, s, self.mesh, self.tp)
        for t, lay in zip(n.outputs, s.out_layouts):
            if sp.root.get(t) == t and t in sp.saved and t not in sp.at_dispatch:
                total += self.numel(t) / shard_factor(lay, mesh) * sp.item[t] * rows_out
        seen = set()
        for i, (t, lay) in enumerate(zip(n.inputs, s.in_layouts)):
            r = sp.root.get(t, t)
            if (sp.owner.get(r) == n.name or sp.at_dispatch.get(r) == n.name) and r not in seen:
                seen.add(r)
                total += self.numel(r) / shard_factor(lay, mesh) * sp.item[r] * (rows_in if i == 0 else 1.0)
        column = self.tp is not None and mesh.shape[self.tp] > 1 and s.tp_role in ("colwise", "colwise_gather")
        for i in sp.copies.get(n.name, ()):
            key = (sp.root.get(n.inputs[i], n.inputs[i]), n.module.rpartition(".")[0])
            if column and self.first_column.get(key, n.name) != n.name:
                continue  # backends/torch/tp.py: a parent's column modules share one cast Replicate input
            total += self.numel(n.inputs[i]) / shard_factor(s.in_layouts[i], mesh) * sp.low * (rows_in if i == 0 else 1)
        for i in sp.weights.get(n.name, ()):
            total += self.numel(n.inputs[i]) / shard_factor(s.in_layouts[i], mesh) * sp.low
        return total

    def held_bytes(self, n: Node, s: Strategy) -> tuple[float, float]:
        """Bytes per device of the output gradients a split backward keeps for ``n`` from B to W (both
        precision modes): W of a node reading a parameter and an activation (a matmul, a norm's scale,
        an expert GEMM) needs the gradient of its output, which ``backends/torch/wsplit.py`` captures at
        B. In the dtype the program makes that output in (``search/layer/saved.py``: under autocast a matmul's
        low, a norm's f32) and in ``s``'s output layout (a column-parallel output sharded, a row-parallel
        partial one whole; an expert-parallel combine's output: the rank's pairs, ``strategies.routed_rows``)."""
        roles = {self.g.tensors[self._base(t)].role for t in n.inputs}
        if n.prim in VIEW_PRIMS or Role.PARAMETER not in roles or Role.ACTIVATION not in roles:
            return 0.0, 0.0
        out, rows = [], routed_rows(n, s, self.mesh, self.tp)[2]  # the combine's: a rank's received pairs
        for sp in (self.saved[0], self.saved[-1]) if self.saved else (None,):
            total = 0.0
            for t, lay in zip(n.outputs, s.out_layouts):
                item = sp.item[t] if sp is not None else float(self.g.tensors[t].itemsize)
                total += self.numel(t) / shard_factor(lay, self.mesh) * item * rows
            out.append(total)
        return out[0], out[-1]

    def grad_transient(self, n: Node, s: Strategy, grad_bytes: float) -> tuple[float, float]:
        """``(one backward, one split W)``: bytes of parameter gradients a backward holds beside the
        accumulated ``.grad`` while it makes those of ``n``'s parameters. Priced where they are large:
        the stacked weight of expert-parallel experts (``backends/torch/moe.py``), which the program
        reads one local expert at a time (``w[j]``); each read's backward makes a zero-filled f32
        gradient of the whole local stack. One backward pass sums them in autograd's input buffer,
        which holds the running sum and the next expert's copy: two stacks of each expert weight of
        the layer. A deferred W (``backends/torch/wsplit.py``) runs one expert's matmul at a time: one
        stack and that expert's own gradient cast to f32 (``1 / experts`` of it). ``partita rehearse``
        of mixtral-8x7b (tp 2, 4 experts a rank: 2.63 GiB of expert gradients): its first stage's W,
        one backward pass, peaked 5.40 GiB over what it held before (priced 5.25); tp 4 (2 experts),
        a deferred W: 1.31 GiB over the gradients (priced 1.31)."""
        moe = n.attrs.get("moe")
        if not moe or moe.get("role") != "weight" or not grad_bytes:
            return 0.0, 0.0
        if s.tp_role != "expert":  # the whole stack's gradient in the compute dtype (saved.stacked_low_grad)
            return stacked_low_grad(grad_bytes, self.state_bytes[1], self.saved[0].low if self.saved else 4.0)
        local = max(1.0, float(moe["num_experts"]) / shard_factor(s.in_layouts[0], self.mesh))
        return 2.0 * grad_bytes, grad_bytes * (1.0 + 1.0 / local)

    def _base(self, t: str) -> str:
        """``t`` through the views that made it (a permuted expert weight is its parameter)."""
        while (u := self.producer.get(t)) is not None and u.prim in VIEW_PRIMS and u.inputs:
            t = u.inputs[0]
        return t

    def _saves(self, n: Node) -> bool:
        """Does ``n``'s backward read its activation inputs? (views and binary elementwise do not)"""
        if n.prim in VIEW_PRIMS or n.prim is Prim.DROPOUT:
            return False  # dropout keeps its mask, not its input
        if n.prim is Prim.ELEMENTWISE:
            acts = [t for t in n.inputs if self.g.tensors[t].role is Role.ACTIVATION]
            return len(acts) == 1
        return True

    def edge_cost(self, t: str, u: Node, su: Strategy, v: Node, sv: Strategy) -> tuple[float, list, float, float]:
        """(seconds, collectives, forward s, backward s) of tensor ``t`` flowing from ``u`` to ``v``.

        A tensor that needs no gradient (a mask, rotary tables: no parameter upstream) has no backward.
        Under ``tp_style="torch"`` a transition the torch runtime cannot build costs FORBIDDEN, and
        the column modules of one parent reading one tensor share its gradient's all-reduce (the
        runtime gives them one Replicate DTensor): each edge is charged its share, and
        :func:`solve_layer` records one.
        """
        lay_u = su.out_layouts[u.outputs.index(t)]
        k = v.inputs.index(t)
        f, fs = self.reshard(lay_u, sv.in_layouts[k], t)
        bad = self.tp_forbidden(lay_u, sv.in_layouts[k])
        colls = [(s.kind, s.axis, s.bytes, "forward", f"reshard {t} -> {v.name}") for s in fs]
        b = 0.0
        if t in self.needs_grad:
            need = grad_requirement(lay_u)
            b, bs = self.reshard(sv.in_grad_layouts[k], need, t)
            bad += self.tp_forbidden(sv.in_grad_layouts[k], need, sv)
            why = self.grad_reason(t, v, sv, f"reshard grad of {t} <- {v.name}")
            if why.startswith("tp input grad"):
                b /= self.shared_grad.get((t, v.module.rpartition(".")[0]), 1)
            colls += [(s.kind, s.axis, s.bytes, "backward", why) for s in bs]
        return f + b + bad, colls, f, b

    def tp_forbidden(self, src: Layout, dst: Layout, consumer: Strategy | None = None) -> float:
        """FORBIDDEN when the torch runtime cannot turn ``src`` into ``dst`` on the tp axis, else 0.

        The only tp transition between ops it builds is a column module's input gradient: partial on
        tp, all-reduced by the Replicate DTensor its input was wrapped in.
        """
        if self.tp is None or src[self.tp] == dst[self.tp]:
            return 0.0
        column = consumer is not None and consumer.tp_role in ("colwise", "colwise_gather")
        return 0.0 if column and (src[self.tp], dst[self.tp]) == ("P", "R") else FORBIDDEN

    def grad_reason(self, t: str, v: Node, sv: Strategy, default: str) -> str:
        """The record reason of ``t``'s gradient resharding into ``v``; one per (tensor, parent) for column modules."""
        if self.tp is not None and sv.tp_role in ("colwise", "colwise_gather"):
            return f"tp input grad of {t} <- {v.module.rpartition('.')[0] or v.name} (column-parallel)"
        return default

    # ---- follower groups, pruning, ILP ------------------------------------------------------
    def _follower_input(self, n: Node) -> str | None:
        """The one in-layer activation input of a follower candidate, else None."""
        if n.prim not in FOLLOWER_PRIMS:
            return None
        acts = [t for t in n.inputs if self.g.tensors[t].role is not Role.PARAMETER]
        if len(acts) != 1 or acts[0] not in self.producer or self.g.tensors[acts[0]].role is not Role.ACTIVATION:
            return None
        if any(self.g.tensors[t].role is Role.BUFFER for t in n.inputs):
            return None
        return acts[0]

    def build_groups(self) -> None:
        self.group_of: dict[str, int] = {}
        self.members: list[list[str]] = []
        self.choices: list[list[tuple[int, ...]]] = []
        for n in self.nodes:
            t = self._follower_input(n)
            if t is not None:
                u = self.producer[t]
                gi = self.group_of[u.name]
                pos, k = self.members[gi].index(u.name), n.inputs.index(t)
                mapping: list[int] = []
                for ch in self.choices[gi]:
                    lay = self.strategies[u.name][ch[pos]].out_layouts[u.outputs.index(t)]
                    ok = [j for j, sv in enumerate(self.strategies[n.name]) if sv.in_layouts[k] == lay]
                    if not ok:
                        break
                    mapping.append(min(ok, key=lambda j: (self.costs[n.name][j].total, j)))
                else:
                    self.members[gi].append(n.name)
                    self.choices[gi] = [ch + (j,) for ch, j in zip(self.choices[gi], mapping)]
                    self.group_of[n.name] = gi
                    continue
            self.group_of[n.name] = len(self.members)
            self.members.append([n.name])
            self.choices.append([(j,) for j in range(len(self.strategies[n.name]))])
        self._prune()

    def _group_cost(self, gi: int, ch: tuple[int, ...]) -> tuple[float, float]:
        cost = mem = 0.0
        chosen = dict(zip(self.members[gi], ch))
        for name, j in chosen.items():
            c = self.costs[name][j]
            cost, mem = cost + c.total, mem + c.memory
            n = self._node(name)
            for t in n.inputs:
                u = self.producer.get(t)
                if u is not None and u.name in chosen:
                    cost += self.edge_cost(t, u, self.strategies[u.name][chosen[u.name]], n, self.strategies[name][j])[
                        0
                    ]
        return cost, mem

    def _node(self, name: str) -> Node:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.nodes}
        return self._by_name[name]

    def _interface(self, gi: int, ch: tuple[int, ...]) -> tuple:
        key: list[tuple] = []
        for name, j in zip(self.members[gi], ch):
            n, s = self._node(name), self.strategies[name][j]
            for t, lay, glay in zip(n.inputs, s.in_layouts, s.in_grad_layouts):
                u = self.producer.get(t)
                if u is not None and self.group_of[u.name] != gi:
                    key.append((t, lay, glay))
            for t, lay in zip(n.outputs, s.out_layouts):
                if any(self.group_of[m.name] != gi for m in self.consumers.get(t, [])):
                    key.append((t, lay))
        return tuple(key)

    def _prune(self) -> None:
        """Drop strategies with the same interface as a cheaper-or-equal, smaller-or-equal one."""
        self.vcost: list[np.ndarray] = []
        self.vmem: list[np.ndarray] = []
        for gi, chs in enumerate(self.choices):
            priced = [(*self._group_cost(gi, ch), k) for k, ch in enumerate(chs)]
            best: dict[tuple, list[float]] = {}
            keep = []
            for _cost, mem, k in sorted(priced):
                key = self._interface(gi, chs[k])
                mems = best.setdefault(key, [])
                if all(mem < m for m in mems):
                    mems.append(mem)
                    keep.append(k)
            keep.sort()
            self.choices[gi] = [chs[k] for k in keep]
            self.vcost.append(np.array([priced[k][0] for k in keep]))
            self.vmem.append(np.array([priced[k][1] for k in keep]))

    def build_problem(self, budget: float) -> ilp.Problem:
        acc: dict[tuple[int, int], np.ndarray] = {}
        for t, u in self.producer.items():
            gu = self.group_of[u.name]
            for v in self.consumers.get(t, []):
                gv = self.group_of[v.name]
                if gv == gu:
                    continue
                m = np.zeros((len(self.choices[gu]), len(self.choices[gv])))
                pu, pv = self.members[gu].index(u.name), self.members[gv].index(v.name)
                memo: dict[tuple[int, int], float] = {}
                for i, ci in enumerate(self.choices[gu]):
                    for j, cj in enumerate(self.choices[gv]):
                        key = (ci[pu], cj[pv])
                        if key not in memo:
                            su, sv = self.strategies[u.name][key[0]], self.strategies[v.name][key[1]]
                            memo[key] = self.edge_cost(t, u, su, v, sv)[0]
                        m[i, j] = memo[key]
                acc[(gu, gv)] = acc[(gu, gv)] + m if (gu, gv) in acc else m
        edges = tuple(ilp.Edge(u, v, m) for (u, v), m in sorted(acc.items()))
        return ilp.Problem(tuple(self.vcost), edges, tuple(self.vmem), budget)

    def chosen(self, choice: Sequence[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for gi, k in enumerate(choice):
            out.update(zip(self.members[gi], self.choices[gi][k]))
        return out


def real_placement(layout: tuple[str, ...], strided: Sequence[int] | None) -> tuple[str, ...]:
    """A parameter's IR layout in the real tensor's dims (``passes/fused_split.py``).

    ``strided = (d, g)``: the IR split the real dim ``d`` into ``(g, n)``; a shard of ``n`` is the
    real ``"SS(d,g)"`` (each of the ``g`` chunks sharded), dims after it move back by one. The
    group dim itself is fixed, never sharded.
    """
    if not strided:
        return layout
    d, g = strided
    out = []
    for p in layout:
        k = shard_dim(p)
        if k is None or k < d:
            out.append(p)
        elif k == d + 1:
            out.append(f"SS({d},{g})")
        elif k > d + 1:
            out.append(f"S({k - 1})")
        else:
            raise AssertionError(f"the group dim of a fused parameter was sharded ({layout})")
    return tuple(out)


def _collectives(raw: Sequence[tuple[str, int, float, str, str]], mesh: LogicalMesh) -> tuple[Collective, ...]:
    counts: dict[tuple[str, str, float, str, str], int] = {}
    for kind, axis, nbytes, phase, why in raw:
        if mesh.shape[axis] > 1 and nbytes > 0:
            key = (kind, mesh.axis_names[axis], float(nbytes), phase, why)
            counts[key] = counts.get(key, 0) + 1
    return tuple(Collective(k, a, b, n, p, r) for (k, a, b, p, r), n in counts.items())


FORBIDDEN = 1e3  # seconds: a tp transition the torch runtime cannot build (never the optimum: all-R is free of it)


def solve_layer(
    graph: Graph,
    layer: Layer,
    mesh: LogicalMesh,
    *,
    env: dict[str, int],
    dtype: str,
    optimizer: str = "adam",
    cost_model: CostModel,
    memory_budget: float | None = None,
    boundary: tuple[str, ...] | None = None,
    backend: str = "auto",
    tp_style: str = "auto",
) -> LayerSolution:
    """Cheapest sharding of ``layer`` on ``mesh`` per micro-batch (module docstring for conventions).

    ``tp_style="megatron"`` keeps batch and sequence dims off the ``tp`` axis (Megatron-LM's engine:
    ``partita evaluate`` and the baselines price hand-made configs so; its vocab-parallel loss and
    the rest of the generic rule stay). ``tp_style="torch"`` restricts the ``tp`` axis to what the
    torch runtime builds (``strategies.torch_tp_strategies``: weights split column- or row-wise,
    heads sharded, no other tp resharding between ops); torch graphs are searched so, and the
    solution's ``tp_plan`` names each tp module's role for the program.
    """
    if tp_style not in TP_STYLES:
        raise ConfigError(f"tp_style {tp_style!r} is unknown.", f"use one of {TP_STYLES}.")
    if cost_model.device.name != mesh.device.name:
        raise ConfigError(
            f"cost model is for {cost_model.device.name} but the mesh is {mesh.device.name}.",
            "pass CostModel.for_device(mesh.device).",
        )
    bnd = tuple(boundary) if boundary is not None else mesh.default_boundary()
    if len(bnd) != mesh.ndim:
        raise ConfigError(
            f"boundary {bnd} has {len(bnd)} placements for a {mesh.ndim}-d mesh.", "give one placement per mesh axis."
        )
    lp = _LayerProblem(graph, layer, mesh, env, dtype, optimizer, cost_model, bnd, tp_style)
    lp.build_groups()
    budget = float(mesh.device.memory_bytes if memory_budget is None else memory_budget)
    problem = lp.build_problem(budget)
    sol = ilp.solve(problem, backend)
    chosen = lp.chosen(sol.choice)
    tot = _Costs()
    raw: list[tuple[str, int, float, str, str]] = []
    for n in lp.nodes:
        c = lp.costs[n.name][chosen[n.name]]
        for f in dataclasses.fields(_Costs):
            if f.name in ("w_grad_transient", "fp8_transient"):
                setattr(tot, f.name, max(getattr(tot, f.name), getattr(c, f.name)))
            elif f.name != "colls":
                setattr(tot, f.name, getattr(tot, f.name) + getattr(c, f.name))
        raw.extend(c.colls)
        for t in n.inputs:
            u = lp.producer.get(t)
            if u is not None:
                total, colls, fw, bw = lp.edge_cost(
                    t, u, lp.strategies[u.name][chosen[u.name]], n, lp.strategies[n.name][chosen[n.name]]
                )
                tot.fwd_comm, tot.bwd_comm = tot.fwd_comm + fw, tot.bwd_comm + bw
                tot.forbidden += total - fw - bw
                raw.extend(colls)
    if tot.forbidden > FORBIDDEN / 2:
        raise InfeasibleError(
            f"layer {layer.name} fits in {budget / 2**30:.2f} GiB per device on a {mesh.shape} mesh only with a "
            "tensor-parallel layout the torch runtime cannot build (backends/torch/tp.py).",
            "give the layer more devices (a larger tp or more pipeline stages) or more memory.",
        )
    raw = _shared_once(raw)
    placements: dict[str, tuple[str, ...]] = {}
    for n in lp.nodes:
        s = lp.strategies[n.name][chosen[n.name]]
        for t, lay in zip(n.inputs, s.in_layouts):
            ten = graph.tensors[t]
            if ten.role is Role.PARAMETER:
                placements.setdefault(ten.fqn or t, real_placement(lay, graph.meta.get("strided_params", {}).get(t)))
    boundary_bytes = sum(
        lp.nbytes(t) / shard_factor(lp.boundary_layout(t), mesh) for t in layer.outputs if t in graph.tensors
    )
    return LayerSolution(
        layer_kind=layer.kind,
        device_type=mesh.device.name,
        mesh_shape=mesh.shape,
        env=dict(env),
        forward_time_s=tot.fwd_compute + tot.fwd_comm,
        backward_time_s=tot.bwd_compute + tot.bwd_comm,
        compute_time_s=tot.fwd_compute + tot.bwd_compute,
        comm_time_s=tot.fwd_comm + tot.bwd_comm,
        grad_sync_bytes=tot.grad_sync_bytes,
        grad_sync_time_s=tot.grad_sync,
        param_bytes=tot.param_bytes,
        grad_bytes=tot.grad_bytes,
        optimizer_bytes=tot.opt_bytes,
        activation_bytes=tot.act_bytes,
        boundary_bytes=boundary_bytes,
        param_placements=placements,
        op_strategies={n.name: lp.strategies[n.name][chosen[n.name]].name for n in lp.nodes},
        collectives=_collectives(raw, mesh),
        stats=sol.stats,
        boundary=bnd,
        selective_keep_bytes=tot.sel_keep,
        selective_forward_s=tot.sel_fwd,
        modes=lp.modes,
        activation_bytes_alt=tot.act_alt,
        selective_keep_bytes_alt=tot.sel_keep_alt,
        transient_bytes=tot.transient + tot.fp8_transient,
        w_held_bytes=tot.held,
        w_held_bytes_alt=tot.held_alt,
        grad_transient_bytes=tot.grad_transient,
        w_grad_transient_bytes=tot.w_grad_transient,
        tp_plan=_tp_plan(lp, chosen),
    )


def _shared_once(raw: list[tuple[str, int, float, str, str]]) -> list[tuple[str, int, float, str, str]]:
    """``raw`` with one all-reduce per (tensor, parent module) of column modules' input grads (edge_cost)."""
    seen: set[tuple] = set()
    out = []
    for r in raw:
        if r[4].startswith("tp input grad of "):
            if r in seen:
                continue
            seen.add(r)
        out.append(r)
    return out


def _tp_plan(lp: _LayerProblem, chosen: Mapping[str, int]) -> dict[str, str]:
    """``{module path: role}`` of the tp modules the solution shards (``strategies.TP_ROLES``): the
    module is the one owning the weight (tied weights are never sharded on tp, so it is unique)."""
    out = {}
    for n in lp.nodes:
        s = lp.strategies[n.name][chosen[n.name]]
        if s.tp_role:
            is_param = [lp.g.tensors[t].role is Role.PARAMETER for t in n.inputs]
            lin = linear_operands(n, is_param)
            w = n.inputs[lin[1] if lin is not None else 0]
            out[(lp.g.tensors[w].fqn or w).rpartition(".")[0]] = s.tp_role
    return out
