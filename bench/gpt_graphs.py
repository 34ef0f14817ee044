"""Trace GPT graphs of given dims once and cache their IR JSON (shared by the search benchmarks)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from partita.ir import Graph

CACHE = Path(os.environ.get("PARTITA_BENCH_CACHE", Path(__file__).parent / ".cache"))
TRACE_SOURCES = ("ir.py", "prims.py", "passes", "frontends/trace_torch.py", "frontends/torch_ops.py", "models")


def gpt_graph(
    hidden: int,
    heads: int,
    layers: int,
    seq: int,
    vocab: int = 51200,
    *,
    megatron_2021: bool = False,
    skip_passes: tuple[str, ...] = (),
    mpt: bool = False,
) -> Graph:
    """GPT-2-architecture model of these dims (the zoo's gpt3 entries), traced at batch 2 (symbolic B).

    ``megatron_2021`` traces ``bench/megatron_gpt.py`` instead: the model Megatron-LM ran when the
    measured rows of ``a100_megatron_measured.csv`` were taken (per-head fused QKV, unfused
    attention, dropout 0.1). ``skip_passes``: pass names left out (ablations). ``mpt``: the GPT-2
    architecture as MosaicML's MPT benchmarks ran it: no dropout, exact (erf) GELU (MPT's biases, which
    GPT-2 cannot drop, stay: a few elementwise adds per block).
    """
    from partita.driver import source_fingerprint, trace_handle
    from partita.models import resolve_model
    from partita.passes.pipeline import PassOptions

    CACHE.mkdir(parents=True, exist_ok=True)
    name = (
        f"gpt_h{hidden}_a{heads}_l{layers}_s{seq}"
        + ("_meg21" if megatron_2021 else "")
        + ("_mpt" if mpt else "")
        + "".join(f"_no-{p}" for p in skip_passes)
    )
    name += f"_{source_fingerprint(TRACE_SOURCES)[:10]}"  # a graph from older tracer / pass code is not reused
    opts = PassOptions(skip=skip_passes)
    out = CACHE / f"{name}.graph.json"
    if out.exists():
        return Graph.from_json(out.read_text())
    if megatron_2021:
        from megatron_gpt import handle

        g = trace_handle(handle(hidden, heads, layers, seq, vocab), batch=2, seq=seq, passes=opts)
        out.write_text(g.to_json())
        return g
    cfg = CACHE / f"{name}.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": hidden,
                "n_head": heads,
                "n_layer": layers,
                "vocab_size": vocab,
                "n_positions": seq,
                **(
                    {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "activation_function": "gelu"}
                    if mpt
                    else {}
                ),
            }
        )
    )
    g = trace_handle(resolve_model(str(cfg)), batch=2, seq=seq, passes=opts)
    out.write_text(g.to_json())
    return g
