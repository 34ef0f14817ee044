"""Hand Megatron tp placements for the model matrix's families (``tests/runtime/test_model_matrix.py``).

Per family, the block-relative paths of the column-parallel and row-parallel modules that tp=2 splits.
Heads are split where the model sizes its attention from the projection's width (``view(..., -1, head_dim)``):
Llama-style, Qwen2(-MoE), GPT-NeoX (``query_key_value`` interleaves q|k|v per head: a contiguous shard holds
whole heads), ViT, BERT and GPT-2 (``c_attn`` split per chunk, ``SS(1,3)``). Where it cannot be, the MLP
alone is split, and :data:`NEAREST` says why (the nearest legal layout the issue asks for). Every tp stage
built from these shards something (``Stage.tp_shards_nothing`` false: the test asserts it).
"""

from __future__ import annotations

from torch import nn

_LLAMA_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_LLAMA = (_LLAMA_COLUMNS, ("self_attn.o_proj", "mlp.down_proj"))
_FALCON_MLP = (("mlp.dense_h_to_4h",), ("mlp.dense_4h_to_h",))
# family -> (column modules, row modules), paths relative to a block; weights [out, in] (nn.Linear)
SPLIT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gemma": _LLAMA,
    "qwen2_moe": (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.shared_expert.gate_proj")
        + ("mlp.shared_expert.up_proj",),
        ("self_attn.o_proj", "mlp.shared_expert.down_proj"),
    ),
    "phi3": (("mlp.gate_up_proj",), ("mlp.down_proj",)),
    "gpt_neox": (
        ("attention.query_key_value", "mlp.dense_h_to_4h"),
        ("attention.dense", "mlp.dense_4h_to_h"),
    ),
    "opt": (("fc1",), ("fc2",)),
    "falcon": _FALCON_MLP,
    "bloom": _FALCON_MLP,
    "bert": (
        ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
        ("attention.output.dense", "output.dense"),
    ),
    "t5": (("DenseReluDense.wi",), ("DenseReluDense.wo",)),
    "vit": (
        ("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
        ("attention.o_proj", "mlp.fc2"),
    ),
    "mixer": (("token_mlp.0", "channel_mlp.0"), ("token_mlp.2", "channel_mlp.2")),
}
# column modules whose output the model chunks (gate | up): each chunk split on its own (``SS(0, chunks)``)
STRIDED = {"phi3": {"mlp.gate_up_proj": 2}}
# transformers' Conv1D keeps weight [in, out]: q|k|v split per chunk, MLP column / row
GPT2 = {
    "attn.c_attn.weight": "SS(1,3)",
    "attn.c_attn.bias": "SS(0,3)",
    "attn.c_proj.weight": "S(0)",
    "mlp.c_fc.weight": "S(1)",
    "mlp.c_fc.bias": "S(0)",
    "mlp.c_proj.weight": "S(0)",
}
HEAD_ONLY = {"convnet": {"fc.weight": "S(0)", "fc.bias": "S(0)"}}  # a column LM/classifier head, gathered
NEAREST = {  # the nearest legal tp layout, where heads and MLP cannot both be split as Megatron does
    "phi3": "MLP only: qkv_proj holds q|k|v of unequal widths (GQA), split at the config's sizes",
    "opt": "MLP only: its attention views q/k/v with the config's head count",
    "falcon": "MLP only: multi-query attention (one k/v head) in one fused weight",
    "bloom": "MLP only: the fused q|k|v is viewed with the config's head count (and ALiBi per head)",
    "t5": "MLP only: the relative position bias holds every head",
    "bert": "q/k/v and the MLP's first linear gathered, their row partners slice a replicated input: "
    "each pair sits in two parent modules (attention.self / attention.output, intermediate / output)",
    "qwen2_moe": "attention and the shared expert; the routed experts replicated",
    "mixtral": "experts by expert (the layer ILP's expert role, expert_plan); attention replicated",
    "convnet": "the classifier head only (convolutions are not tp-split): in tp2 x pp2 stage 0 holds "
    "convolutions alone and shards nothing, which its plan states (tp_shards_nothing, asserted)",
}


def placements(family: str, model: nn.Module, blocks: list[str]) -> dict[str, tuple[str, str]]:
    """``{parameter FQN: ("R", tp placement)}`` for the family's tp-split modules in ``blocks``."""
    out: dict[str, str] = {}
    if family in HEAD_ONLY:
        out = dict(HEAD_ONLY[family])
    for b in blocks:
        if family == "gpt2":
            out |= {f"{b}.{k}": v for k, v in GPT2.items()}
            continue
        columns, rows = SPLIT.get(family, ((), ()))
        for path in columns + rows:
            if family == "t5" and not _has(model, f"{b}.{path}"):
                continue  # T5's plan layers are a block's sub-layers: the feed-forward one holds the MLP
            mod = model.get_submodule(f"{b}.{path}")
            assert isinstance(mod, nn.Linear), (family, path, type(mod))
            chunks = STRIDED.get(family, {}).get(path)
            if path in rows:
                out[f"{b}.{path}.weight"] = "S(1)"
                continue
            out[f"{b}.{path}.weight"] = f"SS(0,{chunks})" if chunks else "S(0)"
            if mod.bias is not None:
                out[f"{b}.{path}.bias"] = f"SS(0,{chunks})" if chunks else "S(0)"
    return {k: ("R", v) for k, v in out.items()}


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True
