"""Expert parallelism of Hugging Face MoE layers over the ``tp`` axis: the ``expert`` tp role.

Called by ``backends/torch/tp.py`` (``tensor_parallel``) for every module the plan gives the role
``expert`` (``Stage.tp_plan``; the search's strategy ``e@tp:expert``, ``search/layer/strategies.py``): a
transformers experts module (``MixtralExperts``, ``Qwen2MoeExperts``: 3-D ``gate_up_proj`` /
``down_proj`` stacked over experts) whose parameters the plan places ``S(0)`` on ``tp``. Each of the
``p`` ranks of the tp group holds ``num_experts / p`` consecutive experts (a DTensor shard).

The router runs replicated on every tp rank (same top-k, same normalization as the model); each rank
routes the pairs of its own token slice and the group all-gathers the per-expert counts (the split
sizes of both all_to_all and the order rows arrive in). Nothing assumes the tp ranks' router outputs
agree bit for bit (``torch.distributed.pipelining`` even runs a first forward on uninitialised
tensors to infer shapes). One call of the module:

==========  ===================================================================  ============
step        what                                                                 collective
==========  ===================================================================  ============
slice       rank ``r`` takes tokens ``[r T/p, (r+1) T/p)`` and their k choices    bwd all_gather (x2)
counts      pairs per expert of every rank's slice (int64, ``p x E``)             all_gather
dispatch    its (token, expert) pairs, sorted by expert, to the owning ranks      all_to_all
experts     each local expert on the pairs it received (``F.linear``, the gate)  -
combine     the results back to the pairs' home rank                              all_to_all
weighting   times the router weights, summed over the k choices                   -
gather      the ``T/p`` finished rows from every rank: the whole output again    all_gather
==========  ===================================================================  ============

The backward runs each step in reverse: the two all_to_all again, the gather's backward takes this
rank's rows (the output gradient is replicated on tp), and the slice's backward all-gathers the
input gradient and the router-weight gradient, so the replicated router and everything before it
see the whole gradient on every rank. Expert gradients stay on the expert's owner: no all-reduce over
tp (they are still summed over ``dp`` with the rest of the stage). What the plan records per call
(``search/strategies.expert_tp_strategies``, the one prediction): forward 2 all_to_all + 2 all_gather,
backward 2 all_to_all + 2 all_gather; all_to_all bytes are the balanced share (pairs / p): the real
size depends on the routing, and only their sum over the group equals the plan's times p.

Under fake tensors (``partita rehearse``, ``backends/torch/rehearse.py``) there are no router values
to route by: the split sizes cannot be read (``.item()``) and ``bincount`` / ``nonzero`` have no
static shape. There the module assumes the balanced routing the plan prices (:func:`_balanced_routing`:
every rank's ``n k`` pairs spread evenly over the experts, so each all_to_all moves ``n k / p`` rows
per peer and each local expert runs ``n k / E`` rows per source rank); the counts all_gather and
everything else run as in a real step.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from partita.errors import PlanError
from partita.frontends import torch_shim

EXPERT = "expert"
WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def is_experts_module(mod: nn.Module) -> bool:
    """A transformers experts module with stacked 3-D expert weights (and no biases)."""
    if not isinstance(getattr(mod, "num_experts", None), int):
        return False
    ws: list[Any] = [w for w in (getattr(mod, a, None) for a in WEIGHTS) if isinstance(w, torch.Tensor)]
    return len(ws) == 2 and all(w.dim() == 3 and w.shape[0] == mod.num_experts for w in ws)


def expert_role(mod: nn.Module, placements: dict[str, str]) -> str | None:
    """``expert`` when ``mod`` is an experts module whose expert weights are all placed ``S(0)``."""
    if not is_experts_module(mod) or getattr(mod, "has_bias", False):
        return None
    names = [a for a in WEIGHTS if isinstance(getattr(mod, a, None), torch.Tensor)]
    if set(placements) <= set(names) and all(placements.get(a) == "S(0)" for a in names):
        return EXPERT
    return None


class _Slice(torch.autograd.Function):
    """Forward: this rank's rows; backward: the rows' gradients of every rank, all-gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int, size: int, group: Any) -> torch.Tensor:
        ctx.rank, ctx.size, ctx.group = rank, size, group
        n = x.shape[0] // size
        return x[rank * n : (rank + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] * ctx.size, *grad.shape[1:]))
        dist.all_gather_single(out, grad, group=ctx.group)
        return out, None, None, None


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with its backward: the gradients travel the reverse way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _Gather(torch.autograd.Function):
    """Forward: every rank's rows, all-gathered; backward: this rank's rows of the replicated gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int, size: int, group: Any) -> torch.Tensor:
        ctx.rank, ctx.n = rank, x.shape[0]
        x = x.contiguous()
        out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


class _Join(torch.autograd.Function):
    """``out`` unchanged, with ``anchors`` (the received rows) as inputs whose gradient is zero. On a rank
    whose local experts received no rows, the combine all_to_all and the dispatch's backward stay in
    the autograd graph (else that rank skips both backward all_to_all and the tp group deadlocks).

    The expert weights are no anchors: every local expert runs, on zero rows where none came, so each
    weight gets its gradient (zeros there) from its own matmuls. A weight anchored here was reachable
    from this node both directly and through the experts' matmuls, so a split backward
    (``backends/torch/wsplit.py``, ZB-H1) had to compute the expert weights' gradients in B rather than
    defer them to W as the plan prices (``partita rehearse`` of mixtral-8x7b: B freed the experts'
    saved tensors, and the later stages held 10-32% less than planned; issue 15)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [a.shape for a in anchors]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (grad, *(grad.new_zeros(shape) for shape in ctx.shapes))


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _sorted_experts(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids sorted, stable order) of a slice's flattened top-k choices."""
    flat = idx.reshape(-1)
    e, order = torch.sort(flat, stable=True)
    return e, order


def _balanced_routing(
    pairs: int, num_experts: int, p: int, r: int
) -> tuple[list[int], list[int], list[list[tuple[int, int]]]]:
    """Rank ``r``'s (send splits, receive splits, per local expert its ``(start, rows)`` spans in the
    received rows) when every rank's ``pairs`` spread evenly over the experts (module docstring)."""
    c = [pairs // num_experts + (e < pairs % num_experts) for e in range(num_experts)]
    per_rank = num_experts // p
    send = [sum(c[d * per_rank : (d + 1) * per_rank]) for d in range(p)]
    mine = c[r * per_rank : (r + 1) * per_rank]
    per_src = sum(mine)
    spans = [[(s * per_src + sum(mine[:j]), mine[j]) for s in range(p)] for j in range(per_rank)]
    return send, [per_src] * p, spans


def expert_parallel_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward with its experts sharded over the tp group (module docstring)."""
    if hidden_states.device.type == "meta":  # shape inference (torch.distributed.pipelining's first step)
        return torch.empty_like(hidden_states)
    ep = self._partita_ep
    group, p, r = ep["group"], ep["size"], ep["rank"]
    num_tokens, k = top_k_index.shape
    if num_tokens % p:
        raise PlanError(
            f"expert parallelism over {p} ranks needs the tokens of a micro-batch ({num_tokens}) to divide by {p}.",
            "choose a micro-batch size x sequence length divisible by the tp degree, or recompile the plan.",
        )
    per_rank = self.num_experts // p
    n = num_tokens // p
    out_dtype, dev = hidden_states.dtype, hidden_states.device.type
    if torch.is_autocast_enabled(dev) and hidden_states.is_floating_point():
        # under autocast the residual stream is f32: the rows travel (and the experts run) in the compute
        # dtype, as the plan prices the dispatch, combine and gather (back to f32 after the gather)
        hidden_states = hidden_states.to(torch.get_autocast_dtype(dev))
    x = _Slice.apply(hidden_states, r, p, group)  # [n, h]
    w = _Slice.apply(top_k_weights, r, p, group)  # [n, k]
    fake = torch_shim.is_fake(hidden_states)  # rehearsal: balanced routing (module docstring)
    with torch.no_grad():  # each rank routes its own slice; the per-expert counts are all-gathered
        mine, order = _sorted_experts(top_k_index[r * n : (r + 1) * n])
        per_expert = mine.new_zeros(self.num_experts) if fake else torch.bincount(mine, minlength=self.num_experts)
        every = per_expert.new_empty(p * self.num_experts)
        dist.all_gather_single(every, per_expert, group=group)
    if fake:
        send_splits, recv_splits, spans = _balanced_routing(n * k, self.num_experts, p, r)
        out = _experts_and_combine(self, x, w, order, send_splits, recv_splits, group, n, k, hidden_states, spans)
        return out.to(out_dtype)
    with torch.no_grad():
        every = every.view(p, self.num_experts)  # [src, expert]
        counts = every.view(p, p, per_rank).sum(dim=-1)  # [src, dst rank]
        block = every[:, r * per_rank : (r + 1) * per_rank]  # [src, my expert]: rows arrive in this order
        recv_e = torch.repeat_interleave(torch.arange(per_rank, device=block.device).repeat(p), block.reshape(-1))
    send_splits = [int(c) for c in counts[r]]
    recv_splits = [int(c) for c in counts[:, r]]
    out = _experts_and_combine(self, x, w, order, send_splits, recv_splits, group, n, k, hidden_states, recv_e)
    return out.to(out_dtype)


def _experts_and_combine(
    self: Any,
    x: torch.Tensor,
    w: torch.Tensor,
    order: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Any,
    n: int,
    k: int,
    hidden_states: torch.Tensor,
    recv_e: Any,
) -> torch.Tensor:
    """Dispatch, the local experts, combine, weighting and gather (module docstring's table). ``recv_e``:
    the local expert of each received row, or (fake tensors) per local expert its row spans."""
    p, r = self._partita_ep["size"], self._partita_ep["rank"]
    per_rank = self.num_experts // p
    send = x[order // k]  # [n k, h], grouped by destination rank
    recv = _AllToAll.apply(send, recv_splits, send_splits, group)
    gate_up = _local(self.gate_up_proj if self.has_gate else self.up_proj)
    down = _local(self.down_proj)
    out = torch.zeros_like(recv)
    for j in range(per_rank):
        if isinstance(recv_e, list):  # balanced spans (fake tensors)
            rows = torch.cat([torch.arange(a, a + c, device=recv.device) for a, c in recv_e[j]])
        else:
            rows = torch.nonzero(recv_e == j).squeeze(-1)
        # an expert that received no rows still runs, on zero rows: its weights get a gradient (zeros), so
        # the dp gradient sync issues the same collectives on every rank whatever the routing
        cur = recv[rows]
        h1 = cur @ gate_up[j] if self.is_transposed else nn.functional.linear(cur, gate_up[j])
        h1 = self._apply_gate(h1) if self.has_gate else self.act_fn(h1)
        h2 = h1 @ down[j] if self.is_transposed else nn.functional.linear(h1, down[j])
        out = out.index_add(0, rows, h2.to(out.dtype))
    out = _Join.apply(out, recv)  # same collectives on every rank, whatever the routing
    back = _AllToAll.apply(out, send_splits, recv_splits, group)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    pairs = back[inv] * w.reshape(-1, 1)  # [n k, h], in (token, choice) order
    local = pairs.view(n, k, -1).sum(dim=1).to(hidden_states.dtype)
    return _Gather.apply(local, r, p, group)


def experts_in_autocast_dtype(module: nn.Module) -> None:
    """Under ``torch.autocast`` (``parallel.apply_autocast``), every experts module of ``module`` that is
    not expert-parallel runs in the autocast dtype: its input rows and its expert weights are cast to
    it (the weights' casts, as autocast casts an ``nn.Linear`` weight) and its output goes back to the
    input's dtype. Transformers' grouped experts call torch's grouped matmul, which autocast does not
    cast: on f32 master weights the CUDA kernel (and its meta function, which ``partita rehearse``
    runs under fake tensors) refuses anything but bf16, so a tp = 1 mixtral stage could neither run
    on a GPU nor rehearse; the plan prices those matmuls and their saved copies in the low dtype
    (``search/layer/saved.py``'s autocast mode). The expert-parallel forward casts its rows itself."""
    mod: Any
    for mod in module.modules():
        if is_experts_module(mod) and not hasattr(mod, "_partita_ep") and not hasattr(mod, "_partita_low"):
            mod._partita_low = False  # True while the cast call runs (functional_call calls forward again)
            mod.forward = types.MethodType(_low_precision_experts, mod)


def _low_precision_experts(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    dev = hidden_states.device.type
    plain = type(self).forward
    if self._partita_low or not torch.is_autocast_enabled(dev) or not hidden_states.is_floating_point():
        return plain(self, hidden_states, *args, **kwargs)
    from torch.func import functional_call

    low = torch.get_autocast_dtype(dev)
    casts = {a: w.to(low) for a in WEIGHTS if isinstance(w := getattr(self, a, None), torch.Tensor)}
    self._partita_low = True
    try:
        out = functional_call(self, casts, (hidden_states.to(low), *args), kwargs)
    finally:
        self._partita_low = False
    return out.to(hidden_states.dtype)


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh, paths: list[str]) -> None:
    """Make each experts module of ``paths`` run :func:`expert_parallel_forward` on ``mesh`` (1-D, tp)."""
    size, rank = mesh.size(), mesh.get_local_rank()
    for path in paths:
        mod: Any = module.get_submodule(path)
        if not is_experts_module(mod) or mod.num_experts % size:
            raise PlanError(
                f"{path} is planned expert-parallel over {size} ranks, but it is no experts module with a "
                f"multiple of {size} experts.",
                "recompile the plan for this model (`partita compile MODEL ...`).",
            )
        mod._partita_ep = {"group": mesh.get_group(), "size": size, "rank": rank}
        mod.forward = types.MethodType(expert_parallel_forward, mod)
