"""Context parallelism (``cp``): every sample's sequence split over a mesh axis beside ``dp`` and ``tp``.

The scheme priced is the one Llama 3 trained its 405B model with at 131,072 tokens (TP 8, CP 16,
PP 16; arXiv:2407.21783, section 3.3.2): **all-gather K/V**. Each of the ``cp`` ranks of a group holds
``S / cp`` consecutive tokens of every sample. Every op but attention is per token, so it runs on the
rank's slice as the same layer at sequence ``S / cp``; attention takes the rank's queries against the
keys and values of the whole sequence, gathered over the ``cp`` axis just before it:

- compute: the layer at ``S / cp`` (``search/pipeline/stage_cost.SolverCosts`` solved at that
  sequence) plus, per attention, ``(cp - 1)`` times its score-matrix FLOPs at ``S / cp`` (the local
  queries meet ``S`` keys, not ``S / cp``: ``cp * (S / cp)**2 = S**2 / cp`` per rank), forward and
  backward (2x, ``cost_model.BACKWARD_MULTIPLIER``);
- communication, per attention and micro-batch: forward one all-gather of K and one of V over ``cp``
  (output: the whole sequence's K or V of this rank's tp share of the key/value heads, before grouped-query
  attention repeats them for the query heads: :func:`_stored_numel`), backward one
  reduce-scatter of their gradients (input of the same size). The program issues them on the
  attention's critical path (the attention needs the gathered K/V; the layer's input gradient needs
  the scattered dK/dV), so they are priced **exposed**, not overlapped with compute. (A ring scheme
  would overlap ``cp - 1`` K/V chunk sends with chunk-wise attention; with grouped-query attention
  the K/V are small next to the attention FLOPs and the gather is a few percent of the layer,
  as Llama 3 reports.);
- memory: activations are those of the layer at ``S / cp`` (so divided by ``cp``), plus the gathered
  K/V that autograd keeps for the attention's backward: ``(cp - 1)`` times the local K/V bytes;
- parameters are replicated over ``cp`` as over ``dp``: their gradients are reduced, and ZeRO shards,
  over the ``dp * cp`` ranks of a stage (torchtitan's ``dp_shard_cp`` mesh).

Ranks are laid out ``(dp, cp, tp)``, tp fastest (``search/pricing/mesh.py``): a ``cp`` axis of
``cp * tp`` devices above a node's size crosses the network by the NIC rule there.

Pure functions over the IR and the cost model: no torch.
"""

from __future__ import annotations

import dataclasses
import math

from partita.cluster import DeviceType, Network
from partita.errors import ConfigError
from partita.ir import DTYPE_BYTES, Graph, Layer, Node, Prim, dim_size
from partita.passes.annotate import FLOP_RULES
from partita.search.pricing.config import TrainingConfig
from partita.search.pricing.cost_model import CostModel
from partita.search.pricing.mesh import AxisLink, LogicalMesh

SCHEME = "all_gather_kv"  # the Plan's name for the scheme priced here (module docstring)


@dataclasses.dataclass(frozen=True)
class CPTerms:
    """What context parallelism adds to one layer, per micro-batch, per device (module docstring)."""

    num_attention: int = 0
    extra_forward_s: float = 0.0  # the local queries against the gathered keys: (cp - 1) x attention at S / cp
    extra_backward_s: float = 0.0
    gather_s: float = 0.0  # forward all-gathers of K and V, exposed
    scatter_s: float = 0.0  # backward reduce-scatters of dK and dV, exposed
    gathered_bytes: float = 0.0  # per attention: K + V of the whole sequence (the all-gathers' outputs)
    extra_saved_bytes: float = 0.0  # gathered K/V beyond the local slice, kept for the backward

    @property
    def comm_s(self) -> float:
        return self.gather_s + self.scatter_s


def check_degree(seq_len: int, cp: int) -> None:
    """Refuse a ``cp`` below 1 or not dividing the sequence (before anything is traced)."""
    if cp < 1:
        raise ConfigError(f"cp={cp} must be >= 1.", "pass a positive --cp (1: no context parallelism).")
    if seq_len % cp:
        ok = [c for c in (2, 4, 8, 16, 32) if seq_len % c == 0]
        raise ConfigError(
            f"cp={cp} does not divide the sequence length {seq_len}: every rank of a context-parallel "
            "group holds the same number of tokens.",
            f"use a cp dividing {seq_len} ({', '.join(map(str, ok)) or 'none of 2..32'}), or another --seq.",
        )


def check(graph: Graph, training: TrainingConfig, cp: int) -> None:
    """Refuse a ``cp`` the scheme cannot run: :func:`check_degree`, a graph whose shapes do not follow
    the sequence length ``S`` (nothing to split), or a model without attention."""
    check_degree(training.seq_len, cp)
    if cp == 1:
        return
    if "S" not in graph.symbols:
        raise ConfigError(
            f"{graph.meta.get('model', graph.name)} was traced without a symbolic sequence length: context "
            "parallelism splits the sequence, and this graph has none to split.",
            "use --cp 1 for this model (a token model traced by partita has one).",
        )
    if not any(n.prim is Prim.ATTENTION for n in graph.nodes):
        raise ConfigError(
            f"{graph.meta.get('model', graph.name)} has no attention: context parallelism splits the sequence "
            "so that attention's keys and values are gathered; without attention it is data parallelism over tokens.",
            "use --cp 1 and a larger --dp instead.",
        )


def local_training(training: TrainingConfig, cp: int) -> TrainingConfig:
    """The training configuration each layer is solved at: sequence ``S / cp``, and ``cp`` times the
    samples, so that ``dp * cp`` replicas of ``S / cp`` tokens hold the same tokens per step."""
    if cp == 1:
        return training
    return dataclasses.replace(training, seq_len=training.seq_len // cp, global_batch=training.global_batch * cp)


def cp_link(device: DeviceType, cp: int, tp: int, gpus_per_node: int, network: Network) -> AxisLink:
    """The link the ``cp`` axis' collectives run on: ranks ``(dp, cp, tp)``, tp fastest."""
    return LogicalMesh((cp, tp), ("cp", "tp"), device, gpus_per_node, network).link(0)


def attention_nodes(graph: Graph, layer: Layer) -> list[Node]:
    return [n for n in (graph.node(x) for x in layer.nodes) if n.prim is Prim.ATTENTION and len(n.inputs) >= 3]


def layer_terms(
    graph: Graph,
    layer: Layer,
    cm: CostModel,
    link: AxisLink,
    *,
    cp: int,
    tp: int,
    micro_batch: int,
    local_seq: int,
    dtype: str,
) -> CPTerms:
    """:class:`CPTerms` of ``layer`` at ``micro_batch`` samples of ``local_seq`` tokens on each of ``cp``
    ranks, heads split over ``tp`` (module docstring). Zero terms for a layer without attention."""
    nodes = attention_nodes(graph, layer)
    if cp == 1 or not nodes:
        return CPTerms()
    env = {"B": 1, "S": local_seq}
    fwd = bwd = gather = scatter = gathered = saved = 0.0
    for n in nodes:
        q = graph.tensors[n.inputs[0]]
        per_sample = micro_batch / max(1, dim_size(q.shape[0], env))  # a static-batch graph: per traced sample
        flops = float(dim_size(FLOP_RULES[Prim.ATTENTION](n, graph), env)) * per_sample / tp  # passes/annotate's rule
        fwd += cm.compute_time(Prim.ATTENTION, cp * flops, 0.0, dtype) - cm.compute_time(
            Prim.ATTENTION, flops, 0.0, dtype
        )
        bwd += cm.backward_compute_time(Prim.ATTENTION, cp * flops, 0.0, dtype) - cm.backward_compute_time(
            Prim.ATTENTION, flops, 0.0, dtype
        )
        k_whole, v_whole = gathered_kv(
            graph, n, cp=cp, tp=tp, micro_batch=micro_batch, local_seq=local_seq, dtype=dtype
        )
        gather += cm.collective_time("all_gather", k_whole, link) + cm.collective_time("all_gather", v_whole, link)
        scatter += cm.collective_time("reduce_scatter", k_whole, link) + cm.collective_time(
            "reduce_scatter", v_whole, link
        )
        gathered += k_whole + v_whole
        saved += (k_whole + v_whole) * (cp - 1) / cp
    return CPTerms(len(nodes), fwd, bwd, gather, scatter, gathered / len(nodes), saved)


def gathered_kv(
    graph: Graph, node: Node, *, cp: int, tp: int, micro_batch: int, local_seq: int, dtype: str
) -> tuple[float, float]:
    """Bytes of the whole sequence's K and of its V that attention ``node`` all-gathers over ``cp`` (the
    all-gathers' outputs, the dK / dV reduce-scatters' inputs): the key/value heads of this rank's tp
    share, ``micro_batch`` samples, in the attention's compute dtype. :func:`layer_terms` prices these and
    the Plan records them (``search/program/context_parallel.py``)."""
    env = {"B": 1, "S": local_seq}
    producers = graph.producers()
    item = DTYPE_BYTES[dtype] if DTYPE_BYTES.get(dtype, 4) < 4 else 4  # K/V in the attention's compute dtype
    q, k, v = (graph.tensors[x] for x in node.inputs[:3])
    per_sample = micro_batch / max(1, dim_size(q.shape[0], env))  # a static-batch graph: per traced sample
    k_local, v_local = (_stored_numel(graph, t.name, env, producers) * per_sample / tp * item for t in (k, v))
    return k_local * cp, v_local * cp


_VIEWS = (Prim.RESHAPE, Prim.EXPAND, Prim.PERMUTE)


def _stored_numel(graph: Graph, name: str, env: dict[str, int], producers: dict[str, Node]) -> int:
    """Elements of the K (or V) the model computes, before views expand it: grouped-query attention's
    ``repeat_kv`` (an EXPAND between RESHAPEs) feeds the attention ``heads / kv_heads`` copies of each
    key/value head, and the program gathers the key/value heads themselves (``backends/torch/context_parallel``
    is called with them). The smallest tensor on the chain of views that ends at the attention's input."""
    best = math.prod(dim_size(d, env) for d in graph.tensors[name].shape)
    node = producers.get(name)
    while node is not None and node.prim in _VIEWS and node.inputs:
        name = node.inputs[0]
        best = min(best, math.prod(dim_size(d, env) for d in graph.tensors[name].shape))
        node = producers.get(name)
    return best


def size_text(nbytes: float) -> str:
    """Bytes for a note: KiB, MiB or GiB (the report's formatting sits above the search)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 2**10:,.1f} KiB"
