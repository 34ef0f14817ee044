"""Random IR graphs, clusters and search options for fuzzing the search, and the property it must keep.

Graphs: an embed layer, N identical blocks, a head.

Built with ``partita.prims`` signature constructors exactly as the tracers build them, with module
paths (``embed``, ``blocks.<i>``, ``head``) so ``passes.run_passes`` groups layers and hashes the
repeated blocks into one kind, as it does for a traced model. A hypothesis strategy draws the
shape of the graph (widths, depth, op mix, dtype); :func:`build` turns a draw into a Graph.
:func:`check_search` is the property (used by ``test_fuzz_search.py`` and ``bench/fuzz.py``).
"""

from __future__ import annotations

import dataclasses

import sympy
from hypothesis import strategies as st

from partita import prims
from partita.cluster import Cluster
from partita.errors import InfeasibleError
from partita.ir import DimSig, Graph, GraphBuilder, Prim, Role
from partita.passes.pipeline import run_passes
from partita.plan import Plan, shares
from partita.search.entry.planner import plan_graph
from partita.search.pricing.config import SearchOptions, TrainingConfig

B, S = sympy.Symbol("B"), sympy.Symbol("S")
OPS = ("linear", "gelu", "norm", "residual", "softmax")


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    in_width: int
    width: int
    out_width: int
    num_blocks: int
    block_ops: tuple[str, ...]  # one block's op sequence (every block repeats it)
    tokens: bool  # activations (B, S, width) instead of (B, width)
    dtype: str


graph_specs = st.builds(
    GraphSpec,
    in_width=st.sampled_from([4, 16, 96]),
    width=st.sampled_from([8, 32, 128, 512, 8192]),  # 8192: billions of parameters, memory-bound
    out_width=st.sampled_from([2, 10, 64]),
    num_blocks=st.integers(0, 4),
    block_ops=st.lists(st.sampled_from(OPS), min_size=8, max_size=12).map(tuple),  # >= 8 nodes: a container
    tokens=st.booleans(),
    dtype=st.sampled_from(["bf16", "f32"]),
)


class _Builder:
    def __init__(self, spec: GraphSpec) -> None:
        self.spec = spec
        self.b = GraphBuilder(f"fuzz{spec.num_blocks}x{spec.width}")
        self.b.symbols.update({"B": (1, 1 << 16), "S": (1, 8192)})
        self.lead: tuple[sympy.Expr, ...] = (B, S) if spec.tokens else (B,)

    def shape(self, width: int) -> tuple[sympy.Expr | int, ...]:
        return (*self.lead, width)

    def param(self, module: str, name: str, shape: tuple[int, ...]) -> str:
        fqn = f"{module}.{name}"
        return self.b.tensor(fqn, shape, self.spec.dtype, Role.PARAMETER, fqn=fqn)

    def op(self, prim: Prim, module: str, name: str, inputs: list[str], width: int, sig: DimSig) -> str:
        out = f"{module}.{name}.out"
        self.b.add(
            prim, inputs, [(out, self.shape(width), self.spec.dtype)], sig, module=module, name=f"{module}.{name}"
        )
        return out

    def linear(self, module: str, name: str, x: str, k: int, n: int) -> str:
        w, bias = self.param(module, f"{name}.weight", (n, k)), self.param(module, f"{name}.bias", (n,))
        return self.op(Prim.MATMUL, module, name, [x, w, bias], n, prims.linear(len(self.lead) + 1, True))

    def block(self, module: str, x: str) -> str:
        width, rank, block_in = self.spec.width, len(self.lead) + 1, x
        for i, kind in enumerate(self.spec.block_ops):
            shp = self.shape(width)
            if kind == "linear":
                x = self.linear(module, f"fc{i}", x, width, width)
            elif kind == "gelu":
                x = self.op(Prim.ELEMENTWISE, module, f"gelu{i}", [x], width, prims.elementwise(shp, [shp]))
            elif kind == "norm":
                w = self.param(module, f"ln{i}.weight", (width,))
                x = self.op(Prim.NORM, module, f"ln{i}", [x, w], width, prims.norm(rank, 1, 1))
            elif kind == "softmax":
                x = self.op(Prim.SOFTMAX, module, f"softmax{i}", [x], width, prims.softmax(rank, -1))
            else:  # residual from the block input
                x = self.op(
                    Prim.ELEMENTWISE, module, f"add{i}", [x, block_in], width, prims.elementwise(shp, [shp] * 2)
                )
        return x

    def build(self) -> Graph:
        s = self.spec
        x = self.b.tensor("x", self.shape(s.in_width), s.dtype, Role.INPUT)
        x = self.linear("embed", "proj", x, s.in_width, s.width)
        for i in range(s.num_blocks):
            x = self.block(f"blocks.{i}", x)
        out = self.linear("head", "out", x, s.width, s.out_width)
        self.b.outputs.append(out)
        return self.b.build({"framework": "test", "model": self.b.name})


def build(spec: GraphSpec) -> Graph:
    """The graph of ``spec`` after the standard passes (annotated, layers grouped)."""
    return run_passes(_Builder(spec).build())


# ---- clusters, training configs, search options -----------------------------------------------
_TINY = {"name": "Tiny", "peak_tflops": {"bf16": 50, "f32": 10}, "hbm_GBps": 500, "intra_node_GBps": 50}
_node = st.fixed_dictionaries(
    {
        "device": st.sampled_from(["A100-80G", "V100-32G", "L4", "T4", "CPU", "Tiny"]),
        "num_nodes": st.integers(1, 2),
        "gpus_per_node": st.sampled_from([1, 2, 4, 8]),
    }
)
_tiny_node = st.fixed_dictionaries({"device": st.just("Tiny"), "num_nodes": st.integers(1, 2)})
cluster_dicts = st.builds(
    lambda nodes, mem, nic: {
        "name": "fuzz",
        "network": {"nic_gbps": nic},
        "nodes": nodes,
        "device_types": [{**_TINY, "memory_GB": mem}],
    },
    st.one_of(st.lists(_node, min_size=1, max_size=2), st.lists(_tiny_node, min_size=1, max_size=1)),
    st.sampled_from([1e-5, 1e-3, 0.05, 2.0]),
    st.sampled_from([10, 200]),
)
trainings = st.builds(
    lambda gb, seq, opt: TrainingConfig(global_batch=gb, seq_len=seq, dtype="bf16", optimizer=opt),
    st.integers(1, 128),
    st.sampled_from([8, 64, 512]),
    st.sampled_from(["adam", "sgd"]),
)
search_options = st.builds(
    lambda schedules, zero, mb, units: SearchOptions(
        schedules=schedules, zero_stages=zero, max_micro_batch=mb, max_layer_units=units, num_alternatives=2
    ),
    st.sampled_from([("1f1b",), ("gpipe",), ("1f1b", "interleaved_1f1b")]),
    st.sampled_from([(0,), (0, 3), (0, 1, 2, 3)]),
    st.sampled_from([1, 4, 32]),
    st.sampled_from([0, 3, 32]),
)


def check_search(graph: Graph, cluster: Cluster, training: TrainingConfig, options: SearchOptions) -> str:
    """The property the fuzzers check: a valid plan that fits by the search's own memory model, or
    an InfeasibleError saying what memory was needed. Returns "plan" or "infeasible"."""
    graph.verify()
    training = dataclasses.replace(training, dtype=graph.tensors[graph.inputs[0]].dtype)
    try:
        plan = plan_graph(graph, cluster, training, options=options)
    except InfeasibleError as err:
        assert "memory" in err.problem and err.fix, err
        return "infeasible"
    text = plan.to_json()
    assert Plan.from_json(text).to_json() == text  # validates, and round-trips byte-identically
    assert [name for s in plan.stages for name in s.layers] == [lay.name for lay in graph.layers]
    assert 0 < plan.predicted["step_time_s"] < float("inf")
    ranks, memory = cluster.ranks(), {d.name: d.memory_bytes for d in cluster.device_types()}
    rank_map = plan.cluster["rank_map"]
    assert len(set(rank_map)) == plan.world_size <= cluster.num_devices
    for s in plan.stages:
        per_replica = s.replica_device_types or (s.device_type,) * s.dp
        for i, dev in enumerate(per_replica):
            for r in s.ranks[i * s.tp : (i + 1) * s.tp]:
                assert ranks[rank_map[r]][1] == dev, (s.index, r, dev)
        assert s.predicted["memory_bytes"] <= min(memory[d] for d in per_replica) * (1 + 1e-9), s
        assert plan.num_micro_batches * sum(shares(s, plan.micro_batch_size)) == training.global_batch
    return "plan"
