"""Capture: a model handle (torch module or JAX loss) -> the annotated IR graph.

First stage of the flow (frontends/): dispatches to ``trace_torch`` (torch.export on the meta
device) or ``trace_jax`` (make_jaxpr on abstract values), then runs the standard passes
(``passes/pipeline.py``). Used by the driver, the JAX emitter (to rebuild a plan's graph) and the
profiler's step probes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing this module (the driver does) loads no IR or sympy
    from partita.ir import Graph
    from partita.passes.pipeline import PassOptions


# torch.export specializes dims of size 0 and 1, so a trace at batch 1 comes out static and the
# search would have to scale it linearly in the batch; at batch 2 the batch dim stays symbolic (B).
TRACE_BATCH = 2


def seq_default(handle: Any) -> int:
    cfg = getattr(handle, "config", None) or {}
    return int(cfg.get("seq_len", 128)) if isinstance(cfg, Mapping) else 128


def trace_handle(
    handle: Any,
    *,
    batch: int = TRACE_BATCH,
    seq: int | None = None,
    passes: PassOptions | None = None,
    repeat: bool = True,
) -> Graph:
    """Trace a zoo/user model handle on abstract values and run the standard passes (``passes``:
    which to skip, for ablations). ``repeat``: trace a few of a deep model's repeated blocks and
    expand them (``frontends/repeat.py``, the same graph as a full trace); False (or the environment's
    ``PARTITA_TRACE_BLOCKS=off``) traces every block."""
    from partita.passes.pipeline import run_passes

    seq = seq or seq_default(handle)
    repeat = repeat and os.environ.get("PARTITA_TRACE_BLOCKS", "").lower() not in ("off", "0", "false")
    if handle.framework == "jax":
        from partita.frontends.trace_jax import trace_jax

        graph = trace_jax(
            handle.loss_fn,
            handle.abstract_params(),
            *handle.example_batch(batch, seq),
            name=handle.name,
            symbolic={"B": batch, "S": seq},
        )
    else:
        from partita.frontends.repeat import trace_by_blocks
        from partita.frontends.trace_torch import trace_module

        inputs = handle.example_inputs(batch, seq, device="meta")
        got = None if not repeat else trace_by_blocks(handle, lambda m: trace_module(m, inputs, name=handle.name))
        graph = got or trace_module(handle.build(device="meta"), inputs, name=handle.name)
    graph.meta.setdefault("framework", handle.framework)
    graph.meta.setdefault("model", handle.name)
    graph = run_passes(graph, passes)
    cfg = getattr(handle, "config", None)  # a Mapping for torch zoo/HF models, a dataclass for JAX ones
    why = cfg.get("no_pipeline") if isinstance(cfg, Mapping) else None  # models/hf.summary (an MoE aux loss)
    if why and not graph.meta.get("no_pipeline"):
        graph.meta["no_pipeline"] = f"{graph.meta.get('model_class', graph.name)}: {why}"
    return graph
