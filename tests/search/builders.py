"""Hand-built IR graphs for the search tests and benchmarks (until the tracer exists).

Every node uses the signature constructors of ``partita.prims`` exactly as the tracers will, so
a traced GPT block has the same prims and signatures. Each builder returns the graph with its
layers filled in; all blocks of one model share one layer ``kind``.
"""

from __future__ import annotations

import sympy

from partita import prims
from partita.ir import DimSig, Graph, GraphBuilder, Layer, Prim, Role

B, S = sympy.Symbol("B"), sympy.Symbol("S")


class _Block:
    """Collects the nodes and params of one layer while it is being built."""

    def __init__(self, b: GraphBuilder, prefix: str) -> None:
        self.b, self.prefix = b, prefix
        self.nodes: list[str] = []
        self.params: list[str] = []

    def param(self, name: str, shape: tuple, dtype: str) -> str:
        t = self.b.tensor(f"{self.prefix}{name}", shape, dtype, Role.PARAMETER, fqn=f"{self.prefix}{name}")
        self.params.append(t)
        return t

    def op(self, prim: Prim, name: str, inputs: list[str], shapes: list[tuple], sig: DimSig, dtype: str) -> list[str]:
        full = f"{self.prefix}{name}"
        outs = [(f"{full}.out{i}" if len(shapes) > 1 else f"{full}.out", shp, dtype) for i, shp in enumerate(shapes)]
        self.nodes.append(full)
        return self.b.add(prim, inputs, outs, sig, name=full, module=self.prefix.rstrip("."), target=name)

    def layer(self, kind: str, inputs: list[str], outputs: list[str]) -> Layer:
        return Layer(
            self.prefix.rstrip("."), tuple(self.nodes), kind, tuple(inputs), tuple(outputs), tuple(self.params)
        )


def _linear(blk: _Block, name: str, x: str, shape_in: tuple, n_out: int, dtype: str, bias: bool = True) -> str:
    w = blk.param(f"{name}.weight", (n_out, shape_in[-1]), dtype)
    ins = [x, w]
    if bias:
        ins.append(blk.param(f"{name}.bias", (n_out,), dtype))
    return blk.op(Prim.MATMUL, name, ins, [(*shape_in[:-1], n_out)], prims.linear(len(shape_in), bias), dtype)[0]


def _layernorm(blk: _Block, name: str, x: str, shape: tuple, dtype: str) -> str:
    w, b = blk.param(f"{name}.weight", (shape[-1],), dtype), blk.param(f"{name}.bias", (shape[-1],), dtype)
    return blk.op(Prim.NORM, name, [x, w, b], [shape], prims.norm(len(shape), 1, 2), dtype)[0]


def _add(blk: _Block, name: str, a: str, b: str, shape: tuple, dtype: str) -> str:
    return blk.op(Prim.ELEMENTWISE, name, [a, b], [shape], prims.elementwise(shape, [shape, shape]), dtype)[0]


def gpt_block(b: GraphBuilder, prefix: str, x: str, hidden: int, num_heads: int, dtype: str = "bf16") -> Layer:
    """Pre-LN GPT block on ``x: [B, S, hidden]`` with a fused qkv linear."""
    blk = _Block(b, prefix)
    h, hd = hidden, hidden // num_heads
    act = (B, S, h)
    ln1 = _layernorm(blk, "ln_1", x, act, dtype)
    qkv = _linear(blk, "attn.qkv", ln1, act, 3 * h, dtype)
    heads = (B, S, num_heads, 3 * hd)
    r = blk.op(Prim.RESHAPE, "attn.view_heads", [qkv], [heads], prims.reshape((B, S, 3 * h), heads), dtype)[0]
    one = (B, S, num_heads, hd)
    q, k, v = blk.op(Prim.SPLIT, "attn.split", [r], [one] * 3, prims.along([4], [4, 4, 4], 3), dtype)
    bhsd = (B, num_heads, S, hd)
    perm = prims.permute(4, (0, 2, 1, 3))
    qt, kt, vt = (
        blk.op(Prim.PERMUTE, f"attn.transpose_{n}", [t], [bhsd], perm, dtype)[0] for n, t in zip("qkv", (q, k, v))
    )
    a = blk.op(Prim.ATTENTION, "attn.sdpa", [qt, kt, vt], [bhsd], prims.attention(bhsd, bhsd, bhsd), dtype)[0]
    at = blk.op(Prim.PERMUTE, "attn.transpose_out", [a], [one], perm, dtype)[0]
    merged = blk.op(Prim.RESHAPE, "attn.merge_heads", [at], [act], prims.reshape(one, act), dtype)[0]
    proj = _linear(blk, "attn.proj", merged, act, h, dtype)
    res1 = _add(blk, "add_1", x, proj, act, dtype)
    ln2 = _layernorm(blk, "ln_2", res1, act, dtype)
    fc = _linear(blk, "mlp.fc", ln2, act, 4 * h, dtype)
    ff = (B, S, 4 * h)
    g = blk.op(Prim.ELEMENTWISE, "mlp.gelu", [fc], [ff], prims.elementwise(ff, [ff]), dtype)[0]
    proj2 = _linear(blk, "mlp.proj", g, ff, h, dtype)
    out = _add(blk, "add_2", res1, proj2, act, dtype)
    return blk.layer(f"gpt_block_h{hidden}_nh{num_heads}", [x], [out])


def gpt(num_layers: int, hidden: int, num_heads: int, dtype: str = "bf16") -> Graph:
    """``num_layers`` identical GPT blocks (no embedding / head)."""
    b = GraphBuilder(f"gpt{num_layers}x{hidden}")
    b.symbols.update({"B": (1, 4096), "S": (1, 65536)})
    x = b.tensor("x", (B, S, hidden), dtype, Role.INPUT)
    layers = []
    for i in range(num_layers):
        layer = gpt_block(b, f"h.{i}.", x, hidden, num_heads, dtype)
        layers.append(layer)
        x = layer.outputs[0]
    b.outputs.append(x)
    g = b.build({"framework": "test"})
    g.layers = layers
    return g


def gpt_with_ends(
    num_layers: int, hidden: int, num_heads: int, vocab: int = 512, dtype: str = "bf16", light: bool = False
) -> Graph:
    """:func:`gpt` between a first layer (``embed``: a linear standing in for the embedding) and a last one
    (``head``: the output projection): a model whose ends are layers of their own kinds, as a traced one's.
    ``light``: each block only its MLP and residual add (a tenth of the nodes: 126 blocks build in a second)."""
    b = GraphBuilder(f"gpt{num_layers}x{hidden}_ends")
    b.symbols.update({"B": (1, 4096), "S": (1, 65536)})
    x = b.tensor("x", (B, S, hidden), dtype, Role.INPUT)
    first = _Block(b, "embed.")
    y = _linear(first, "proj", x, (B, S, hidden), hidden, dtype, bias=False)
    layers = [first.layer("embed", [x], [y])]
    for i in range(num_layers):
        if light:
            blk = _Block(b, f"h.{i}.")
            mid = _linear(blk, "fc", y, (B, S, hidden), 4 * hidden, dtype)
            out = _linear(blk, "proj", mid, (B, S, 4 * hidden), hidden, dtype)
            layers.append(blk.layer(f"mlp_block_h{hidden}", [y], [_add(blk, "add", y, out, (B, S, hidden), dtype)]))
        else:
            layers.append(gpt_block(b, f"h.{i}.", y, hidden, num_heads, dtype))
        y = layers[-1].outputs[0]
    last = _Block(b, "head.")
    out = _linear(last, "proj", y, (B, S, hidden), vocab, dtype, bias=False)
    layers.append(last.layer("head", [y], [out]))
    b.outputs.append(out)
    g = b.build({"framework": "test"})
    g.layers = layers
    return g


def mlp(hidden: int, ffn: int, dtype: str = "bf16") -> Graph:
    """Two linears with a GELU on ``x: [B, hidden]``."""
    b = GraphBuilder("mlp")
    x = b.tensor("x", (B, hidden), dtype, Role.INPUT)
    blk = _Block(b, "mlp.")
    fc = _linear(blk, "fc", x, (B, hidden), ffn, dtype)
    g = blk.op(Prim.ELEMENTWISE, "gelu", [fc], [(B, ffn)], prims.elementwise((B, ffn), [(B, ffn)]), dtype)[0]
    out = _linear(blk, "proj", g, (B, ffn), hidden, dtype)
    b.outputs.append(out)
    graph = b.build()
    graph.layers = [blk.layer(f"mlp_h{hidden}_f{ffn}", [x], [out])]
    return graph


def moe(hidden: int, ffn: int, num_experts: int, top_k: int, capacity: int, dtype: str = "bf16") -> Graph:
    """GShard-style MoE layer: router linear + softmax + top-k, one-hot dispatch einsum into
    ``[e, b, c, h]`` expert buffers, per-expert matmuls with an expert dim ``e``, combine einsum."""
    b = GraphBuilder("moe")
    e, c, h, f = num_experts, capacity, hidden, ffn
    x = b.tensor("x", (B, S, h), dtype, Role.INPUT)
    blk = _Block(b, "moe.")
    logits = _linear(blk, "router", x, (B, S, h), e, dtype, bias=False)
    probs = blk.op(Prim.SOFTMAX, "router.softmax", [logits], [(B, S, e)], prims.softmax(3, -1), dtype)[0]
    vals, idx = blk.op(Prim.TOPK, "router.topk", [probs], [(B, S, top_k)] * 2, prims.topk(3, -1), dtype)
    mask_sig = DimSig(("bsk", "bsk"), ("bsec",), "", "kec")  # one-hot of (expert, capacity slot), gate-weighted
    mask = blk.op(Prim.SCATTER, "dispatch_mask", [idx, vals], [(B, S, e, c)], mask_sig, dtype)[0]
    disp = blk.op(Prim.MATMUL, "dispatch", [mask, x], [(e, B, c, h)], prims.einsum("bsec,bsh->ebch"), dtype)[0]
    tok = (e, B * c, h)
    flat = blk.op(Prim.RESHAPE, "flatten", [disp], [tok], prims.reshape((e, B, c, h), tok), dtype)[0]
    w1 = blk.param("experts.w1", (e, f, h), dtype)
    h1 = blk.op(Prim.MATMUL, "experts.fc1", [flat, w1], [(e, B * c, f)], prims.einsum("ebk,enk->ebn"), dtype)[0]
    act = (e, B * c, f)
    g = blk.op(Prim.ELEMENTWISE, "experts.gelu", [h1], [act], prims.elementwise(act, [act]), dtype)[0]
    w2 = blk.param("experts.w2", (e, h, f), dtype)
    h2 = blk.op(Prim.MATMUL, "experts.fc2", [g, w2], [tok], prims.einsum("ebk,enk->ebn"), dtype)[0]
    back = blk.op(Prim.RESHAPE, "unflatten", [h2], [(e, B, c, h)], prims.reshape(tok, (e, B, c, h)), dtype)[0]
    comb = blk.op(Prim.MATMUL, "combine", [mask, back], [(B, S, h)], prims.einsum("bsec,ebch->bsh"), dtype)[0]
    out = _add(blk, "add", x, comb, (B, S, h), dtype)
    b.outputs.append(out)
    graph = b.build()
    graph.layers = [blk.layer(f"moe_h{h}_e{e}", [x], [out])]
    return graph
