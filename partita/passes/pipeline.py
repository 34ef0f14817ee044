"""The pass pipeline: one named list of ``Graph -> Graph`` rewrites run between tracing and search.

``run_passes(graph, options)`` applies ``PASSES`` in order. ``CHECK=1`` in the environment (or
``options.check``) runs the IR verifier after every pass, so a broken pass is named at once;
``DUMP_IR=<dir>`` (or ``options.dump_dir``) writes the printed graph after each pass.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from partita.errors import IRError
from partita.ir import Graph
from partita.passes.annotate import annotate
from partita.passes.boundaries import pipeline_refusal
from partita.passes.fused_split import split_fused_projections
from partita.passes.fusion import fuse_pointwise
from partita.passes.layers import group_layers
from partita.passes.moe import mark_experts

Pass = Callable[[Graph], Graph]


def dce(graph: Graph) -> Graph:
    """Drop nodes none of whose outputs reach a graph output (HF helpers leave a few behind)."""
    live = set(graph.outputs)
    keep: list[bool] = []
    for n in reversed(graph.nodes):
        used = any(o in live for o in n.outputs)
        keep.append(used)
        if used:
            live.update(n.inputs)
    kept = [n for n, k in zip(graph.nodes, reversed(keep)) if k]
    produced = {o for n in kept for o in n.outputs}
    dropped = {o for n in graph.nodes for o in n.outputs} - produced
    tensors = {k: v for k, v in graph.tensors.items() if k not in dropped}
    return dataclasses.replace(graph, tensors=tensors, nodes=kept, layers=[])


# Model classes whose torch stages run several model chunks per rank (interleaved 1F1B, ZB-V): the ones
# with a hand adapter (backends/torch/parallel.ADAPTERS; a test checks the two agree). Every other module
# tree is cut by the generic splitter (backends/torch/stages.py), one contiguous layer range per rank.
CHUNKED_CLASSES = frozenset({"GPT2LMHeadModel", "LlamaForCausalLM"})


def pipeline_cuts(graph: Graph) -> Graph:
    """Mark a torch graph that no pipeline cut can run (``passes/boundaries.pipeline_refusal``): the
    search then keeps it to one stage and says why (``graph.meta["no_pipeline"]``). A graph the
    runtime pipelines but not in model chunks gets ``graph.meta["no_chunks"]``: the search leaves
    interleaved 1F1B with ``v > 1`` and ZB-V out for it (``search/entry/planner.py``)."""
    if graph.meta.get("no_pipeline") or graph.meta.get("framework", "torch") != "torch":
        return graph  # a reason given before (kept), or a JAX graph (its runtime cuts by its own rules)
    cls = graph.meta.get("model_class", graph.name)
    meta = dict(graph.meta)
    if cls not in CHUNKED_CLASSES:
        meta["no_chunks"] = (
            f"{cls} runs through the generic stage splitter (backends/torch/stages.py): one contiguous "
            "layer range per rank, no model chunks"
        )
    why = pipeline_refusal(graph)
    if why:
        meta["no_pipeline"] = f"{cls}: {why}"
    return dataclasses.replace(graph, meta=meta) if meta != graph.meta else graph


PASSES: list[tuple[str, Pass]] = [
    ("dce", dce),  # remove dead nodes before costing them
    ("split_fused_projections", split_fused_projections),  # q|k|v in one weight: shardable per chunk
    ("mark_experts", mark_experts),  # MoE experts subgraphs: the expert-parallel strategy's nodes
    ("annotate", annotate),  # node.flops / node.bytes_moved
    ("group_layers", group_layers),  # node.layer, graph.layers with structural kinds
    ("fuse_pointwise", fuse_pointwise),  # drop bytes of intermediates a fusing backend keeps on chip
    ("pipeline_cuts", pipeline_cuts),  # meta["no_pipeline"] / ["no_chunks"]: what the torch runtime cannot cut
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassOptions:
    skip: tuple[str, ...] = ()
    check: bool | None = None  # None: read CHECK from the environment
    dump_dir: str | None = None  # None: read DUMP_IR from the environment


def run_passes(graph: Graph, options: PassOptions | None = None) -> Graph:
    opts = options or PassOptions()
    check = opts.check if opts.check is not None else os.environ.get("CHECK", "0") not in ("", "0")
    dump = opts.dump_dir if opts.dump_dir is not None else os.environ.get("DUMP_IR") or None
    names = {name for name, _ in PASSES}
    unknown = [s for s in opts.skip if s not in names]
    if unknown:
        raise IRError(f"unknown pass(es) {unknown} in skip", f"choose from {[n for n, _ in PASSES]}")
    if check:
        graph.verify()
    for k, (name, fn) in enumerate(PASSES):
        if name in opts.skip:
            continue
        graph = fn(graph)
        if check:
            try:
                graph.verify()
            except IRError as err:
                raise IRError(f"after pass {name!r}: {err.problem}", err.fix) from None
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / f"{k:02d}_{name}.txt").write_text(graph.as_text())
    return graph
