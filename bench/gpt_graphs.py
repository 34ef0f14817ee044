"""Trace GPT graphs of given dims once and cache their IR JSON (shared by the search benchmarks)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from partita.ir import Graph

CACHE = Path(os.environ.get("PARTITA_BENCH_CACHE", Path(__file__).parent / ".cache"))


def gpt_graph(hidden: int, heads: int, layers: int, seq: int, vocab: int = 51200) -> Graph:
    """GPT-2-architecture model of these dims (the zoo's gpt3 entries), traced at batch 1."""
    from partita.compiler.driver import trace_handle
    from partita.models import resolve_model

    CACHE.mkdir(parents=True, exist_ok=True)
    name = f"gpt_h{hidden}_a{heads}_l{layers}_s{seq}"
    out = CACHE / f"{name}.graph.json"
    if out.exists():
        return Graph.from_json(out.read_text())
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
            }
        )
    )
    g = trace_handle(resolve_model(str(cfg)), batch=1, seq=seq)
    out.write_text(g.to_json())
    return g
