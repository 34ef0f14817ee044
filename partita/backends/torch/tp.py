"""Megatron-style tensor parallelism for one pipeline stage, from the plan's tp plan and placements.

Called through ``torch_parallel.distribute_params`` by the generated program
(``backends/torch/emit.py`` writes the placements and the module roles this file derives), and by
the emitter itself (:func:`module_roles` on the model built on the meta device, and
:func:`tp_collectives` for the program's predicted collectives).

Activations between modules stay plain local tensors, as in Megatron-LM and torchtitan; DTensor
runs only inside the modules whose parameters the plan shards over ``tp``. Each such module has a
*role*, the ILP's choice for it: a searched plan carries them as data (``Stage.tp_plan``, written by
``search/layer/intra_op.py`` from the strategies of ``search/strategies.torch_tp_strategies``, which
are exactly the roles below), the program writes them literally (``roles={...}``) and
:func:`module_roles` checks each against the module's parameter placements (``nn.Linear`` keeps
weight ``[out, in]``, transformers' ``Conv1D`` ``[in, out]``). The roles and their ParallelStyle
equivalents (``torch.distributed.tensor.parallel``):

========================  =================================================  ===============  =============
role                      what the hooks do                                  forward           backward
========================  =================================================  ===============  =============
``colwise``               input -> Replicate DTensor, output stays sharded   -                 all_reduce [1]
``colwise_gather``        same, then all-gather the output                   all_gather        all_reduce [1]
``rowwise``               local sharded input -> Shard(-1), Partial -> R     all_reduce        -
``rowwise_replicated``    replicated input sliced to Shard(-1), Partial -> R all_reduce        all_gather
``vocab``                 nn.Embedding sharded on the vocabulary             all_reduce        -
``embed_dim``             nn.Embedding sharded on the hidden dim             all_gather        -
``expert``                an experts module sharded by expert (``moe.py``)   2 all_to_all,     2 all_to_all,
                          tokens sliced, dispatched, combined, gathered      2 all_gather      2 all_gather
``colwise_sp``            input: sequence shard -> Shard(1) -> Replicate     all_gather [1]    reduce_scatter
``rowwise_sp``            as ``rowwise``, Partial -> Shard(1) (sequence)     reduce_scatter    all_gather
``sequence_parallel``     a block: its input sliced to this rank's sequence  all_gather (out)  all_gather (in),
                          shard, its output gathered (first / last of the                      all_reduce per
                          stage's blocks); its plain parameters' gradients                     plain parameter
                          summed over tp (the norms ran on a shard)
========================  =================================================  ===============  =============

Megatron sequence parallelism (Korthikanti et al. 2022; torchtitan's ``SequenceParallel`` norms,
``ColwiseParallel(input_layouts=Shard(1))``, ``RowwiseParallel(output_layouts=Shard(1))``): a stage
whose plan gives its blocks the role ``sequence_parallel`` keeps the residual stream between its
first and last block as this rank's slice of the sequence (dim 1, ``[b, s/t, h]``): norms, residual
adds and every other op outside the tp modules run on ``s/t`` rows. The column modules all-gather
their (cast) input once per parent and the row modules reduce-scatter their output. The norms'
weights stay plain tensors; a gradient hook sums each over tp (the ``SequenceParallel`` style's
Replicate weights would leave a Partial gradient for the optimizer to reduce), registered on the
object the owning module runs with (under FSDP2, its unsharded parameter, before FSDP2's
reduce-scatter over dp reads the gradient). Unlike torchtitan the
embedding and the LM head keep their non-SP roles: the stage's first block slices its input (no
communication forward, an all-gather of the gradient backward) and its last block all-gathers its
output (the final norm and the head then run on the whole sequence).

(``colwise`` = ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)``, ``colwise_gather``
= ``ColwiseParallel(output_layouts=Replicate())``, ``rowwise`` = ``RowwiseParallel(input_layouts=Shard(-1))``,
``rowwise_replicated`` = ``RowwiseParallel(input_layouts=Replicate())``, ``vocab`` = ``RowwiseParallel``
on an embedding, ``embed_dim`` = ``ColwiseParallel(output_layouts=Replicate())`` on one. Hooks instead of
``parallelize_module``: ``Conv1D`` and per-head strided weights are no ``nn.Linear``, and column
siblings share their input's Replicate DTensor.)

[1] one per parent module: column siblings (``q/k/v_proj``, ``gate/up_proj``) read the same input
tensor and share one Replicate DTensor, so their input gradients meet in one all-reduce.

Plans without a ``tp_plan`` (hand-written placements, plans of older versions) get the roles
derived from the placements alone, by this rule: a column module keeps its output sharded only
when its parent also holds a row module (the
Megatron pair: attention ``q/k/v`` + ``o``, MLP ``fc`` + ``proj``) and the model does not split
its output along a contiguously sharded dim (the adapter's ``fused`` list: GPT-2's ``c_attn`` is
q|k|v in one weight). A fused module placed ``"SS(d,g)"`` (``passes/fused_split.py``: each of the
``g`` chunks sharded on its own, DTensor's ``_StridedShard``) holds ``[q_r | k_r | v_r]``, whole
heads, so it stays ``colwise``; the adapter's ``strided_attrs`` names the parent's attributes
that size the local split (GPT-2's ``split_size``), divided by tp on the rank. A contiguous
``"S(d)"`` on a fused module is gathered and attention runs on all heads, replicated. A row module whose parent has no sharded-output column gets its input
replicated and slices it. Parameters of unsharded modules stay plain tensors: outside a
parent of column modules their inputs and output gradients are replicated over ``tp``, so their gradients
agree without communication; inside one, a module that takes a column module's sharded output (Qwen3's
per-head ``q_norm``) has its parameters' gradients summed over ``tp`` (:func:`_region_params`), so no
parameter ever holds a partial gradient. Any
other sharded layout (e.g. a sharded norm weight) runs as ``generic``: DTensor propagation inside
the module with a replicated input and output; correct, but its collectives are not predicted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from partita.backends.torch import moe
from partita.backends.torch.regather import Regather
from partita.errors import PlanError
from partita.frontends.torch_shim import strided_shard

# tests only: the module path of a row module whose forward all-reduce is dropped (a broken layout that
# `partita run --reference` must catch: tests/runtime/test_run_reference.py)
DROP_ENV = "PARTITA_TEST_DROP_ALL_REDUCE"
COLUMN, COLUMN_GATHER, ROW, ROW_REPLICATED = "colwise", "colwise_gather", "rowwise", "rowwise_replicated"
VOCAB, EMBED_DIM, GENERIC = "vocab", "embed_dim", "generic"
EXPERT = moe.EXPERT  # an experts module sharded over tp by expert (backends/torch/moe.py: all_to_all dispatch)
COLUMN_SP, ROW_SP, SEQUENCE = "colwise_sp", "rowwise_sp", "sequence_parallel"  # Megatron SP (module docstring)
SP_ROLES = (COLUMN_SP, ROW_SP, SEQUENCE)
SEQ_DIM = 1  # the sequence dim of a block's activations [b, s, h] (torchtitan's Shard(1))
SEQ_SPLIT = "partita_seq_split"  # on a block whose input is 1/tp of the rows (parallel._llama_block's positions)
ROLES = (COLUMN, COLUMN_GATHER, ROW, ROW_REPLICATED, VOCAB, EMBED_DIM, EXPERT, *SP_ROLES, GENERIC)


def parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    m = re.fullmatch(r"S\((-?\d+)\)", text)
    if m:
        return Shard(int(m.group(1)))
    ss = _strided(text)
    if ss is not None and ss[1] > 1:
        return strided_shard(*ss)
    raise PlanError(
        f"parameter placement {text!r} cannot be applied to a parameter.",
        "parameters take 'R', 'S(d)' or 'SS(d,g)' per mesh axis; 'P' (partial) is only for activations.",
    )


def _strided(text: str) -> tuple[int, int] | None:
    """``(dim, groups)`` of a strided-shard placement ``"SS(d,g)"``, else None."""
    m = re.fullmatch(r"SS\((\d+),(\d+)\)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _weight_dims(mod: nn.Module) -> tuple[int, int] | None:
    """(out dim, in dim) of a linear-like module's 2-D weight, or None for other modules."""
    if isinstance(mod, nn.Linear):
        return 0, 1
    w = getattr(mod, "weight", None)
    if type(mod).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2:
        return 1, 0  # transformers.pytorch_utils.Conv1D: y = x @ W + b with W [in, out]
    return None


def _own_role(mod: nn.Module, pl: Mapping[str, str]) -> str | None:
    """Role from a module's own parameter placements alone (column / row resolved later)."""
    if all(v == "R" for v in pl.values()):
        return None
    if moe.expert_role(mod, dict(pl)):
        return EXPERT
    w, b = pl.get("weight", "R"), pl.get("bias", "R")
    if isinstance(mod, nn.Embedding) and set(pl) == {"weight"}:
        return {"S(0)": VOCAB, "S(1)": EMBED_DIM}.get(w, GENERIC)
    dims = _weight_dims(mod)
    if dims is None or not set(pl) <= {"weight", "bias"}:
        return GENERIC
    out_dim, in_dim = dims
    if w == f"S({out_dim})" and b in ("S(0)", "R") and (b == "S(0)" or getattr(mod, "bias", None) is None):
        return COLUMN
    ws, bs = _strided(w), _strided(b)
    strided_b = ws is not None and bs == (0, ws[1])
    if ws is not None and ws[0] == out_dim and (strided_b or (b == "R" and getattr(mod, "bias", None) is None)):
        return COLUMN  # each chunk (q, k, v) column-split: rank r holds whole heads
    if w == f"S({in_dim})" and b == "R":
        return ROW
    return GENERIC


def with_aliases(model: nn.Module, placements: Mapping[str, str]) -> dict[str, str]:
    """``placements`` extended to every FQN of a tied parameter (GPT-2's ``lm_head.weight`` is ``wte``'s)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    by_fqn = {n: group for group in names.values() for n in group}
    out = dict(placements)
    for fqn, pl in placements.items():
        for other in by_fqn.get(fqn, ()):
            out.setdefault(other, pl)
    return out


_ROLE_OF_OWN = {
    "": (SEQUENCE,),  # a block: no tp-sharded parameter of its own
    COLUMN: (COLUMN, COLUMN_GATHER, COLUMN_SP),
    ROW: (ROW, ROW_REPLICATED, ROW_SP),
    VOCAB: (VOCAB,),
    EMBED_DIM: (EMBED_DIM,),
    EXPERT: (EXPERT,),
}


def module_roles(
    model: nn.Module,
    placements: Mapping[str, str],
    fused: Sequence[str] = (),
    plan_roles: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``{module path: role}`` for every module with a tp-sharded parameter (module docstring).

    ``placements`` maps parameter FQNs to their ``tp`` placement; works on a model built on the
    meta device (the emitter) as on the real one (the runtime). ``plan_roles``: the plan's
    ``tp_plan`` (the ILP's role per module), returned as given for the modules of ``model`` after
    checking each against the module's placements (PlanError on any disagreement: the plan was made
    for another model). Without it the roles are derived; ``fused``: module-path suffixes whose
    output the model splits along the feature dim (gathered, never kept sharded).
    """
    if plan_roles:
        return _checked_roles(model, placements, plan_roles)
    per_module: dict[str, dict[str, str]] = {}
    for fqn, pl in with_aliases(model, placements).items():
        path, _, attr = fqn.rpartition(".")
        per_module.setdefault(path, {})[attr] = pl
    strided = {p for p, mine in per_module.items() if _strided(mine.get("weight", "")) is not None}
    own = {}
    for path, mine in sorted(per_module.items()):
        role = _own_role(model.get_submodule(path), mine)
        if role is not None:
            own[path] = role
    parent = {p: p.rpartition(".")[0] for p in own}
    has_row = {parent[p] for p, r in own.items() if r == ROW}
    roles = {}
    for p, r in own.items():
        if r == COLUMN:
            contiguous_fused = p not in strided and any(p == f or p.endswith("." + f) for f in fused)
            keep = parent[p] in has_row and not contiguous_fused
            roles[p] = COLUMN if keep else COLUMN_GATHER
        else:
            roles[p] = r
    sharded_out = {parent[p] for p, r in roles.items() if r == COLUMN}
    for p, r in roles.items():
        if r == ROW and parent[p] not in sharded_out:
            roles[p] = ROW_REPLICATED
    return roles


def _checked_roles(model: nn.Module, placements: Mapping[str, str], plan_roles: Mapping[str, str]) -> dict[str, str]:
    """``plan_roles`` restricted to ``model``'s modules, each checked against its own placements."""
    per_module: dict[str, dict[str, str]] = {}
    for fqn, pl in with_aliases(model, placements).items():
        path, _, attr = fqn.rpartition(".")
        per_module.setdefault(path, {})[attr] = pl
    names = {n for n, _ in model.named_modules()}
    out: dict[str, str] = {}
    for path, role in sorted(plan_roles.items()):
        if role not in ROLES or role == GENERIC:
            raise PlanError(f"the plan's tp role {role!r} of {path} is unknown.", f"tp roles are {ROLES[:-1]}.")
        if path not in names:
            continue  # another stage's module (a stage holds some of the plan's layers)
        own = _own_role(model.get_submodule(path), per_module.get(path, {}))
        if role not in _ROLE_OF_OWN.get(own or "", ()):
            raise PlanError(
                f"the plan makes {path} {role!r} but places its parameters {per_module.get(path, {})}.",
                "recompile the plan for this model (`partita compile MODEL ...`); do not edit plan.json by hand.",
            )
        out[path] = role
    sharded = {p for p, mine in per_module.items() if p in names and any(v != "R" for v in mine.values())}
    missing = sorted(sharded - set(out))
    if missing:
        raise PlanError(
            f"the plan shards parameters of {missing[:4]} on tp but gives those modules no tp role.",
            "recompile the plan for this model (`partita compile MODEL ...`).",
        )
    return out


def tp_collectives(roles: Mapping[str, str], no_input_grad: Sequence[str] = ()) -> dict[str, dict[str, int]]:
    """Collectives per micro-batch the hooks issue: ``{"forward": {kind: n}, "backward": {kind: n}}``.

    ``no_input_grad``: module paths fed the program's input (no gradient, so no backward all-reduce).
    """
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}

    def add(d: dict[str, int], kind: str) -> None:
        d[kind] = d.get(kind, 0) + 1

    for role in roles.values():
        if role in (ROW, ROW_REPLICATED, VOCAB):
            add(fwd, "all_reduce")
        if role == ROW_SP:
            add(fwd, "reduce_scatter")
            add(bwd, "all_gather")
        if role in (COLUMN_GATHER, EMBED_DIM):
            add(fwd, "all_gather")
        if role == ROW_REPLICATED:
            add(bwd, "all_gather")
        if role == EXPERT:  # moe.py: fwd counts + output all_gather, dispatch + combine; bwd: also both slices
            for d, kind in ((fwd, "all_to_all"), (fwd, "all_gather"), (bwd, "all_to_all"), (bwd, "all_gather")):
                add(d, kind)
                add(d, kind)
    cols = [p for p, r in roles.items() if r in (COLUMN, COLUMN_GATHER) and p not in no_input_grad]
    for _ in {p.rpartition(".")[0] for p in cols}:
        add(bwd, "all_reduce")
    for _ in {p.rpartition(".")[0] for p, r in roles.items() if r == COLUMN_SP}:
        add(fwd, "all_gather")
        add(bwd, "reduce_scatter")
    if any(r == SEQUENCE for r in roles.values()):  # the region's ends (the norms' gradient sums: not counted)
        add(fwd, "all_gather")
        add(bwd, "all_gather")
    return {"forward": fwd, "backward": bwd}


# ---- runtime ---------------------------------------------------------------------------------
class _Hooks:
    """Forward pre/post hooks of the tp modules of one stage (one instance per stage)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.shared: dict[str, dict[int, tuple[torch.Tensor, DTensor]]] = {}
        # per parent call (_region_params): the autograd node count when it began, and the grad_fn ids of its
        # column modules' sharded outputs (sources) and of its row modules' whole outputs (stops)
        self.begin: dict[str, int] = {}
        self.sources: dict[str, set[int]] = {}
        self.stops: dict[str, set[int]] = {}
        self.alive: dict[str, list[Any]] = {}  # keeps the recorded nodes alive for the call (ids stay unique)

    def clear(self, parent: str) -> None:
        self.shared.pop(parent, None)

    def start(self, parent: str) -> None:
        """A region parent's forward begins: nodes created from now on belong to this call."""
        for d in (self.sources, self.stops, self.alive):
            d.pop(parent, None)
        if torch.is_grad_enabled():
            probe = torch.zeros((), requires_grad=True) * 1.0
            self.begin[parent] = probe.grad_fn._sequence_nr()  # type: ignore[union-attr]

    def mark(self, parent: str, out: Any, sharded: bool) -> None:
        fn = getattr(out, "grad_fn", None)
        if fn is not None:
            (self.sources if sharded else self.stops).setdefault(parent, set()).add(id(fn))
            self.alive.setdefault(parent, []).append(fn)

    def from_shard(self, parent: str, xs: Sequence[Any]) -> bool:
        """Whether any of ``xs`` was computed, inside this call of ``parent``, from a column module's
        sharded output (not through a row module's output): a walk of the autograd graph back to the
        nodes created before the call began."""
        sources, stops, begin = self.sources.get(parent, set()), self.stops.get(parent, set()), self.begin.get(parent)
        if not sources or begin is None:
            return False
        todo = [x.grad_fn for x in xs if isinstance(x, torch.Tensor) and x.grad_fn is not None]
        seen: set[int] = set()
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in seen or id(fn) in stops or fn._sequence_nr() < begin:
                continue
            if id(fn) in sources:
                return True
            seen.add(id(fn))
            todo += [nxt for nxt, _ in fn.next_functions]
        return False

    def sum_whole_edges(self, parent: str, x: torch.Tensor) -> None:
        """Where a whole tensor meets this rank's shard inside ``parent``, sum its gradient over tp.

        ``x`` is a row module's sharded input. Walking its autograd graph back through this call of
        ``parent``, a node is *sharded* when it is a column module's output or reads a sharded node. A
        sharded node's edge to a *whole* one (computed in this call from replicated values only, or before
        the call: DeepSeek-V3's rope key ``k_pe``, sliced from the plain ``kv_a_proj_with_mqa``'s output
        and broadcast over this rank's heads) carries this rank's heads' part of that tensor's gradient:
        a node hook sums it over tp (Megatron's copy-to-tensor-parallel-region, placed where the layouts
        meet). Backward is linear in the gradient, so the sum there equals the one device's. Edges to
        parameters are left to :func:`_region_params`; a column module's input is summed by its DTensor."""
        sources, stops, begin = self.sources.get(parent, set()), self.stops.get(parent, set()), self.begin.get(parent)
        root = getattr(x, "grad_fn", None)
        if not sources or begin is None or root is None:
            return
        kind: dict[int, str] = {}  # per node: "shard", "whole" (activations) or "param" (parameters only)
        order, todo = [], [root]
        while todo:  # post-order over the nodes of this call
            fn = todo.pop()
            if id(fn) in kind:
                continue
            if id(fn) in sources or type(fn).__name__ == "AccumulateGrad":
                kind[id(fn)] = "shard" if id(fn) in sources else "param"
                continue
            if id(fn) in stops or fn._sequence_nr() < begin:
                kind[id(fn)] = "whole"
                continue
            nxt = [n for n, _ in fn.next_functions if n is not None and id(n) not in kind]
            if nxt:
                todo += [fn, *nxt]
                continue
            got = {kind[id(n)] for n, _ in fn.next_functions if n is not None}
            kind[id(fn)] = "shard" if "shard" in got else "whole" if "whole" in got else "param"
            order.append(fn)
        summed = _tp_sum(self.mesh)
        for fn in order:
            if kind[id(fn)] != "shard":
                continue
            # parameters (Gemma 3's ``1 + weight`` of a per-head norm included) are summed by _region_params
            whole = [i for i, (n, _) in enumerate(fn.next_functions) if n is not None and kind[id(n)] == "whole"]
            if whole:
                fn.register_hook(_sum_inputs(whole, summed))
                self.alive.setdefault(parent, []).append(fn)

    def replicated(self, parent: str, x: torch.Tensor) -> DTensor:
        """One Replicate DTensor per input tensor among a parent's column modules (one grad all-reduce)."""
        cache = self.shared.setdefault(parent, {})
        hit = cache.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        dev = x.device.type
        if x.is_floating_point() and torch.is_autocast_enabled(dev):
            # cast before the DTensor boundary, as autocast would inside the matmul: the input gradient's
            # all-reduce then moves the compute dtype, as Megatron's (and the plan's records, search/program/records.py)
            d = DTensor.from_local(x.to(torch.get_autocast_dtype(dev)), self.mesh, [Replicate()], run_check=False)
            cache[id(x)] = (x, d)
            return d
        d = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        cache[id(x)] = (x, d)
        return d

    def pre(self, role: str, parent: str, in_features: int) -> Any:
        mesh = self.mesh

        def hook(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x, rest = args[0], args[1:]
            if isinstance(x, DTensor):
                return args
            if role in (COLUMN, COLUMN_GATHER):
                return (self.replicated(parent, x), *rest)
            if role == COLUMN_SP:
                raise PlanError(
                    f"{type(mod).__name__} is column-parallel on the whole sequence, but its input arrives as "
                    "this rank's rows (its parent module did not gather them).",
                    "recompile the plan for this model; sequence parallelism needs the column modules' parent "
                    "to take the block's hidden states as its first input.",
                )
            if role == ROW_REPLICATED:  # arrives replicated: take this rank's slice
                dt = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                return (dt.redistribute(mesh, [Shard(x.dim() - 1)]), *rest)
            if role in (ROW, ROW_SP):
                if role == ROW and mesh.size() > 1 and torch.is_grad_enabled():
                    self.sum_whole_edges(parent, x)
                if mesh.size() > 1 and x.shape[-1] == in_features:
                    raise PlanError(
                        f"{type(mod).__name__} is row-parallel on a sharded input, but its input arrives whole "
                        f"({x.shape[-1]} features).",
                        "the module before it is not column-parallel in this model: recompile the plan.",
                    )
                return (DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False), *rest)
            return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *rest)

        return hook

    def post(self, role: str, parent: str, drop: bool = False) -> Any:
        mesh = self.mesh

        def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            if not isinstance(out, DTensor):
                return out
            if drop:  # a deliberately broken layout (DROP_ALL_REDUCE_ENV, tests only): this rank's partial sum
                return out.to_local()
            if role in (COLUMN, COLUMN_SP):  # this rank's heads / features (a source of _region_params)
                res = out.to_local()
                self.mark(parent, res, sharded=True)
                return res
            if role == ROW_SP:  # Partial -> this rank's rows: a reduce-scatter (its gradient all-gathers)
                res = out.redistribute(mesh, [Shard(SEQ_DIM)]).to_local()
            else:
                res = out.redistribute(mesh, [Replicate()]).to_local()
            # to_local() returns a view made inside a custom autograd Function, which autograd forbids
            # modifying in place; these outputs rejoin the residual stream, where a model may (Falcon's
            # ``mlp_output += attention_output`` raised at tp=2): a plain copy, as one device has
            res = res.clone()
            self.mark(parent, res, sharded=False)  # whole again (ROW_SP: rows, whole features)
            return res

        return hook


def _in_features(mod: nn.Module) -> int:
    dims, w = _weight_dims(mod), getattr(mod, "weight", None)
    return int(w.shape[dims[1]]) if dims is not None and isinstance(w, torch.Tensor) else -1


def _localize_attrs(
    module: nn.Module,
    placements: Mapping[str, str],
    roles: Mapping[str, str],
    strided_attrs: Mapping[str, Sequence[str]],
    tp: int,
) -> None:
    """Divide the parent attributes that size a strided column module's split by ``tp``."""
    for path, role in roles.items():
        if role not in (COLUMN, COLUMN_SP) or _strided(placements.get(f"{path}.weight", "")) is None:
            continue
        for suffix, attrs in strided_attrs.items():
            if path != suffix and not path.endswith("." + suffix):
                continue
            parent = module.get_submodule(path.rpartition(".")[0])
            for a in attrs:
                v = getattr(parent, a)
                if not isinstance(v, int) or v % tp:
                    raise PlanError(
                        f"{path.rpartition('.')[0]}.{a} = {v!r} does not split over tp={tp}.",
                        "choose a tp that divides the model's head count.",
                    )
                setattr(parent, a, v // tp)


def tensor_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Mapping[str, str],
    fused: Sequence[str] = (),
    roles: Mapping[str, str] | None = None,
    strided_attrs: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, str]:
    """Shard ``module``'s parameters over ``mesh`` and install the role hooks; returns the roles.

    ``roles``, when given (the generated program writes the plan's ``tp_plan``), are applied as
    given after :func:`module_roles` checks them against the placements (PlanError: the program
    was emitted for a different model); without them they are derived from the placements.
    ``strided_attrs``: ``{module suffix: parent attributes}`` divided by tp where that module is
    column-parallel with an ``"SS(d,g)"`` weight (module docstring).
    """
    alias: dict[str, nn.Parameter] = dict(module.named_parameters(remove_duplicate=False))
    unknown = sorted(set(placements) - set(alias))
    if unknown:
        raise PlanError(
            f"the plan places parameters {unknown[:4]} that this stage does not have.",
            "recompile the plan for this model.",
        )
    derived = module_roles(module, placements, fused, roles)
    # Every parameter of a tp module becomes a DTensor (placement from the plan, else Replicate);
    # tied parameters (one object under several FQNs) stay one object.
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append((mod, attr))
    done: set[int] = set()
    for path in derived:
        if derived[path] == SEQUENCE:
            continue  # a block: its own tp modules are placed on their own
        for _, p in list(module.get_submodule(path).named_parameters(recurse=False)):
            if id(p) in done:
                continue
            names = [n for n, q in alias.items() if q is p]
            given = {placements[n] for n in names if n in placements}
            if len(given) > 1:
                raise PlanError(f"tied parameter {names} has conflicting placements {sorted(given)}.", "recompile.")
            pl = parse_placement(given.pop() if given else "R")
            new = nn.Parameter(distribute_tensor(p.data, mesh, [pl]), requires_grad=p.requires_grad)
            for mod, a in owners[id(p)]:
                setattr(mod, a, new)
            done.add(id(new))
    _localize_attrs(module, placements, derived, strided_attrs or {}, mesh.size())
    moe.apply_expert_parallel(module, mesh, [p for p, r in derived.items() if r == EXPERT])
    hooks = _Hooks(mesh)
    for path, role in derived.items():
        if role in (EXPERT, SEQUENCE):
            continue  # experts: forward replaced (moe.py); blocks: _sequence_region below
        mod, parent = module.get_submodule(path), path.rpartition(".")[0]
        mod.register_forward_pre_hook(hooks.pre(role, parent, _in_features(mod)))
        mod.register_forward_hook(hooks.post(role, parent, drop=role == ROW and path == os.environ.get(DROP_ENV)))
    _region_params(module, mesh, derived, hooks)
    _sequence_region(module, mesh, [p for p, r in derived.items() if r == SEQUENCE])
    for parent in sorted({p.rpartition(".")[0] for p, r in derived.items() if r == COLUMN_SP}):
        gather, done = _gather_rows(mesh)
        module.get_submodule(parent).register_forward_pre_hook(gather, with_kwargs=True)
        module.get_submodule(parent).register_forward_hook(done)
    for parent in {p.rpartition(".")[0] for p, r in derived.items() if r in (COLUMN, COLUMN_GATHER, COLUMN_SP)}:
        owner = module.get_submodule(parent)  # the shared input lives for one call of the parent
        owner.register_forward_pre_hook(lambda m, a, parent=parent: hooks.clear(parent))
        owner.register_forward_hook(lambda m, a, o, parent=parent: hooks.clear(parent))
    return derived


def _gather_rows(mesh: DeviceMesh) -> tuple[Any, Any]:
    """Forward pre- and post-hook of a ``colwise_sp`` parent (torchtitan's ``PrepareModuleInput(Shard(1) ->
    Replicate)`` on attention / MLP): its hidden states, this rank's rows (cast to the autocast dtype
    first, as :meth:`_Hooks.replicated`), become one all-gathered Replicate DTensor that its column
    modules share (their input gradients meet in one reduce-scatter). Inside the parent the shapes are
    the whole sequence's (``view(*input_shape, -1, head_dim)``). Without recompute the parent's saved
    copies of the gathered tensor are this rank's rows, gathered again in the backward (``regather.py``)."""

    active: list[Regather | None] = []

    def gather(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        dev = x.device.type
        if x.is_floating_point() and torch.is_autocast_enabled(dev):
            x = x.to(torch.get_autocast_dtype(dev))
        full = DTensor.from_local(x, mesh, [Shard(SEQ_DIM)], run_check=False).redistribute(mesh, [Replicate()])
        if active and active[-1] is None and Regather.wanted(mesh):  # keep x's rows, gather again in backward
            active[-1] = Regather(mesh, x, full, SEQ_DIM).__enter__()
        return full

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        active.append(None)
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    def done(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        ctx = active.pop() if active else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    return hook, done


def _sequence_region(module: nn.Module, mesh: DeviceMesh, blocks: Sequence[str]) -> None:
    """Megatron sequence parallelism over ``blocks`` (module docstring): the first slices its input to
    this rank's rows, the last all-gathers its output, and each plain parameter inside them (a norm's
    weight, which saw only this rank's rows) gets its gradient summed over tp by a hook."""
    if not blocks:
        return
    order = {n: i for i, (n, _) in enumerate(module.named_modules())}
    blocks = sorted(blocks, key=order.__getitem__)
    tp = mesh.size()

    def to_rows(x: Any) -> Any:  # Replicate -> Shard(1): a local slice (its gradient all-gathers)
        if not isinstance(x, torch.Tensor) or x.dim() <= SEQ_DIM:
            return x
        if x.shape[SEQ_DIM] % tp:
            raise PlanError(
                f"sequence parallelism splits the sequence ({x.shape[SEQ_DIM]} tokens) over tp={tp}, which "
                "does not divide it.",
                "choose a sequence length divisible by tp, or drop --sequence-parallel.",
            )
        d = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return d.redistribute(mesh, [Shard(SEQ_DIM)]).to_local()

    def to_all(x: Any) -> Any:  # Shard(1) -> Replicate: an all-gather (its gradient is a local slice)
        if not isinstance(x, torch.Tensor) or x.dim() <= SEQ_DIM:
            return x
        d = DTensor.from_local(x, mesh, [Shard(SEQ_DIM)], run_check=False)
        return d.redistribute(mesh, [Replicate()]).to_local()

    def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if args:
            return (to_rows(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": to_rows(kwargs["hidden_states"])}

    def leave(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        if isinstance(out, tuple):
            return (to_all(out[0]), *out[1:])
        return to_all(out)

    module.get_submodule(blocks[0]).register_forward_pre_hook(enter, with_kwargs=True)
    for path in blocks[1:]:  # their input holds 1/tp of the rows: an adapter sizing positions reads this
        setattr(module.get_submodule(path), SEQ_SPLIT, tp)
    module.get_submodule(blocks[-1]).register_forward_hook(leave)

    def summed(g: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(g, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    def hook_params(mod: nn.Module, args: tuple[Any, ...]) -> None:
        # registered when the module that owns the parameter runs, on the object it runs with:
        # materializing the stage (to_empty, the rehearsal's fake mode) may replace the parameters the
        # setup saw, and FSDP2 swaps its unsharded ones in from the block's own pre-forward
        for p in mod.parameters(recurse=False):
            if not isinstance(p, DTensor) and p.requires_grad and not getattr(p, _SUMMED, False):
                p.register_hook(summed)
                setattr(p, _SUMMED, True)

    for path in blocks:
        for mod in module.get_submodule(path).modules():
            if any(True for _ in mod.parameters(recurse=False)):
                mod.register_forward_pre_hook(hook_params)


_SUMMED = "_partita_tp_summed"  # a plain parameter whose gradient hook sums it over tp (_sequence_region)
_REGION = "_partita_tp_region"  # a plain parameter that ran inside a Megatron region (_region_params)
_WHOLE = "_partita_tp_whole"  # a plain parameter of a tp parent that ran on whole (replicated) activations


def _tp_sum(mesh: DeviceMesh) -> Any:
    """A gradient hook: this rank's partial gradient -> the sum over tp (one all-reduce)."""

    def summed(g: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(g, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    return summed


def _sum_inputs(indices: Sequence[int], summed: Any) -> Any:
    """A node hook: the gradients the node passes to its inputs ``indices`` summed over tp (``summed``)."""

    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(summed(g) if i in indices and g is not None else g for i, g in enumerate(grad_inputs))

    return hook


def _region_params(module: nn.Module, mesh: DeviceMesh, roles: Mapping[str, str], hooks: _Hooks) -> None:
    """No parameter of a tp parent holds a partial gradient (issue 31: Qwen3's per-head ``q_norm``).

    A parent of column modules whose outputs stay sharded (attention's ``q/k/v_proj``, the MLP's
    ``gate/up_proj``) computes, from those outputs up to its row module, on this rank's heads or
    features only. A module inside the parent that is not itself a tp module (a per-head norm) and
    takes such a tensor (:meth:`_Hooks.from_shard`: computed in this call from a column output, not
    through a row output) computes its parameters' gradients from this rank's heads alone, so each is
    summed over tp by a gradient hook (as the sequence-parallel norms are): every rank then holds the
    full, equal gradient. One whose input is whole (DeepSeek-V3's ``kv_a_proj_with_mqa`` on the hidden
    states) keeps its gradient. A parameter used both ways, or a plain parameter of the parent module
    itself (its use inside the parent's forward cannot be placed; gpt-oss's per-head attention
    ``sinks``), is refused: the plan must shard it or keep that module replicated.
    """
    parents = sorted({p.rpartition(".")[0] for p, r in roles.items() if r in (COLUMN, COLUMN_SP)})
    tp_paths = set(roles)
    summed = _tp_sum(mesh)
    for parent in parents:
        owner = module.get_submodule(parent)
        own = [n for n, p in owner.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if own and mesh.size() > 1:
            raise PlanError(
                f"{parent} ({type(owner).__name__}) holds parameter(s) {own} of its own, beside the tp-sharded "
                "modules it calls; which heads or features they act on cannot be known, so their gradients could "
                "not be made whole.",
                "keep this module replicated over tp (no sharded placements under it), or shard those "
                "parameters in the plan.",
            )
        owner.register_forward_pre_hook(lambda m, a, parent=parent: hooks.start(parent))
        for sub, mod in owner.named_modules():
            path = f"{parent}.{sub}" if sub else parent
            if not sub or any(path == t or path.startswith(t + ".") for t in tp_paths):
                continue
            if not any(True for _ in mod.parameters(recurse=False)):
                continue
            mod.register_forward_pre_hook(_region_hook(parent, path, hooks, summed), with_kwargs=True)


def _region_hook(parent: str, path: str, hooks: _Hooks, summed: Any) -> Any:
    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        inside = hooks.from_shard(parent, [*args, *kwargs.values()])
        for name, p in mod.named_parameters(recurse=False):
            if isinstance(p, DTensor) or not p.requires_grad:
                continue
            # registered on the object the module runs with (under FSDP2 its unsharded parameter)
            if getattr(p, _REGION if not inside else _WHOLE, False):
                raise PlanError(
                    f"{path}.{name} runs both on this rank's tp shard and on whole activations inside {parent}, "
                    "so no one gradient rule fits it.",
                    "keep this module replicated over tp (no sharded placements under it).",
                )
            if inside and not getattr(p, _SUMMED, False):  # one sum (a sequence-parallel block's may be there)
                p.register_hook(summed)
                setattr(p, _SUMMED, True)
            setattr(p, _REGION if inside else _WHOLE, True)

    return hook
