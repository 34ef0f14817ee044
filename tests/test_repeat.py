"""frontends/repeat.py: tracing 3 blocks and expanding them gives the graph of a full trace."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from partita.frontends import repeat
from partita.frontends.trace import trace_handle
from partita.frontends.trace_torch import trace_module
from partita.ir import Graph, Role
from partita.models.zoo import _hf_handle

TINY = dict(vocab_size=128)
SPECS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **TINY,
    ),
    "gpt2": dict(n_embd=64, n_head=4, n_positions=32, **TINY),
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        **TINY,
    ),
}


def _handle(kind: str, num_layers: int) -> Any:
    key = "n_layer" if kind == "gpt2" else "num_hidden_layers"
    return _hf_handle(f"{kind}-{num_layers}", kind, "test", **{key: num_layers}, **SPECS[kind])


def _canonical(g: Graph) -> str:
    """The graph's JSON with activation / node names replaced by their position (what a full trace
    and an expanded one may name differently where torch.export spends names on dropped nodes)."""
    names: dict[str, str] = {}
    for k, n in enumerate(g.nodes):
        names[n.name] = f"n{k}"
        for j, o in enumerate(n.outputs):
            names[o] = f"n{k}.{j}"
    d = json.loads(g.to_json())
    d["meta"].pop("traced_blocks", None)

    def sub(x: Any) -> Any:
        if isinstance(x, str):
            return names.get(x, x)
        if isinstance(x, list):
            return [sub(v) for v in x]
        if isinstance(x, dict):
            return {k: sub(v) for k, v in x.items()}
        return x

    return json.dumps(sub(d), sort_keys=True)


def _both(kind: str, num_layers: int) -> tuple[Graph, Graph]:
    h = _handle(kind, num_layers)
    full = trace_handle(h, seq=16, repeat=False)
    expanded = trace_handle(h, seq=16, repeat=True)
    assert "traced_blocks" not in full.meta
    assert expanded.meta["traced_blocks"] == [repeat.TRACED_BLOCKS, num_layers]  # the shortcut was taken
    return full, expanded


def _assert_same(full: Graph, expanded: Graph) -> None:
    assert expanded.num_params() == full.num_params()
    assert expanded.forward_flops() == full.forward_flops()
    assert [p.fqn for p in expanded.params()] == [p.fqn for p in full.params()]
    assert [(la.name, la.kind, len(la.nodes), la.params) for la in expanded.layers] == [
        (la.name, la.kind, len(la.nodes), la.params) for la in full.layers
    ]
    assert _canonical(expanded) == _canonical(full)
    expanded.verify()


def test_llama_expanded_graph_equals_the_full_trace() -> None:
    full, expanded = _both("llama", 5)
    _assert_same(full, expanded)
    assert len({la.kind for la in full.layers if la.name.startswith("model.layers.")}) == 1


def test_gpt2_expanded_graph_equals_the_full_trace() -> None:
    full, expanded = _both("gpt2", 5)
    _assert_same(full, expanded)


@pytest.mark.slow
def test_mixtral_expanded_graph_equals_the_full_trace() -> None:
    full, expanded = _both("mixtral", 6)
    _assert_same(full, expanded)


def test_the_shortcut_is_taken_and_shallow_models_trace_fully() -> None:
    h = _handle("llama", 5)
    inputs = h.example_inputs(2, 16)
    calls: list[int] = []

    def trace(m: Any) -> Graph:
        calls.append(m.config.num_hidden_layers)
        return trace_module(m, inputs, name=h.name)

    assert repeat.trace_by_blocks(h, trace) is not None
    assert calls == [repeat.TRACED_BLOCKS]
    assert repeat.trace_by_blocks(_handle("llama", repeat.MIN_BLOCKS - 1), trace) is None


def test_blocks_that_differ_are_refused() -> None:
    """A traced graph whose last two blocks differ (here: one op's attrs) is not expanded."""
    h = _handle("llama", 5)
    import torch

    with torch.device("meta"):
        m = h.depth_builder(repeat.TRACED_BLOCKS)
    g = trace_module(m, h.example_inputs(2, 16), name=h.name)
    assert repeat.expand_blocks(g, repeat.TRACED_BLOCKS, 5) is not None
    k = next(i for i, n in enumerate(g.nodes) if n.module.startswith("model.layers.2.") and n.attrs)
    bad = dataclasses.replace(g.nodes[k], attrs={**g.nodes[k].attrs, "changed": 1})
    g2 = dataclasses.replace(g, nodes=[*g.nodes[:k], bad, *g.nodes[k + 1 :]])
    assert repeat.expand_blocks(g2, repeat.TRACED_BLOCKS, 5) is None
    # a parameter of block 2 that is really block 1's (a shared weight) is refused too
    p1 = next(t for t in g.tensors.values() if t.role is Role.PARAMETER and t.name.startswith("model.layers.1."))
    k = next(i for i, n in enumerate(g.nodes) if p1.name.replace(".1.", ".2.", 1) in n.inputs)
    n = g.nodes[k]
    swapped = tuple(p1.name if i == p1.name.replace(".1.", ".2.", 1) else i for i in n.inputs)
    g3 = dataclasses.replace(g, nodes=[*g.nodes[:k], dataclasses.replace(n, inputs=swapped), *g.nodes[k + 1 :]])
    assert repeat.expand_blocks(g3, repeat.TRACED_BLOCKS, 5) is None
