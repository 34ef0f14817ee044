"""Config.json contents for the Hugging Face architecture families Partita is checked on.

Used by the model matrix test (``tests/runtime/test_model_matrix.py``: tiny sizes, trained on CPU
ranks against the single-device run) and ``bench/models.py`` (realistic sizes: traced, counted
and compiled). Each entry is what a user's ``config.json`` holds: ``model_type``, the training
architecture and the size keys of that family; ``write_config`` puts one in a directory, the
form ``partita trace DIR`` and ``resolve_model(DIR)`` take.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Shape keys per family: (hidden, layers, heads, kv heads, ffn, vocab, positions) are filled in below.
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("gpt2", "GPT2LMHeadModel", {"n_embd": "h", "n_layer": "l", "n_head": "a", "n_positions": "p"}),
    "llama": ("llama", "LlamaForCausalLM", {}),
    "mistral": ("mistral", "MistralForCausalLM", {}),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", {}),
    "qwen2_moe": (
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": "f/2",
            "shared_expert_intermediate_size": "f",
        },
    ),
    "mixtral": ("mixtral", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("phi3", "Phi3ForCausalLM", {}),
    "gemma": ("gemma", "GemmaForCausalLM", {"head_dim": "h/a"}),
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM", {}),
    "opt": ("opt", "OPTForCausalLM", {"ffn_dim": "f", "word_embed_proj_dim": "h"}),
    "falcon": ("falcon", "FalconForCausalLM", {"new_decoder_architecture": False, "multi_query": True}),
    "bloom": ("bloom", "BloomForCausalLM", {"n_layer": "l", "n_head": "a"}),
    "bert": ("bert", "BertForMaskedLM", {}),
    "t5": (  # as t5-small's config.json: the decoder starts from the pad id
        "t5",
        "T5ForConditionalGeneration",
        {"d_model": "h", "d_ff": "f", "num_layers": "l", "num_heads": "a", "decoder_start_token_id": 0},
    ),
    "vit": ("vit", "ViTForImageClassification", {"image_size": 32, "patch_size": 8, "num_labels": 10}),
    # the parity matrix's families (tests/runtime/test_parity_matrix.py): per-head norms (Qwen3, Gemma 3),
    # MoE (Qwen3-MoE, DeepSeek-V3 with MLA attention, gpt-oss), a fused-qkv encoder, a state-space model
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {"head_dim": "h/a"}),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {"head_dim": "h/a", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": "f/2"},
    ),
    "gemma3_text": ("gemma3_text", "Gemma3ForCausalLM", {"head_dim": "h/a", "sliding_window": "p/2"}),
    "deepseek_v3": (
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": "a",
            "moe_intermediate_size": "f/4",
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": "h/2",
            "kv_lora_rank": "h/4",
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": "h/a",
        },
    ),
    "modernbert": (
        "modernbert",
        "ModernBertForMaskedLM",
        {"global_attn_every_n_layers": 1, "cls_token_id": 0, "sep_token_id": 0},
    ),
    "mamba": ("mamba", "MambaForCausalLM", {"state_size": 8, "expand": 2}),
    "gpt_oss": (
        "gpt_oss",
        "GptOssForCausalLM",
        {
            "head_dim": "h/a",
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": "h",
            "sliding_window": "p/2",
        },
    ),
}
# the families the model matrix trains (tests/runtime/test_model_matrix.py); the parity matrix adds MORE_FAMILIES
MORE_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text", "deepseek_v3", "modernbert", "mamba", "gpt_oss")
FAMILIES = tuple(f for f in _FAMILIES if f not in MORE_FAMILIES)
_COMMON = {  # the Llama-style key names most families share
    "hidden_size": "h",
    "num_hidden_layers": "l",
    "num_attention_heads": "a",
    "num_key_value_heads": "k",
    "intermediate_size": "f",
    "vocab_size": "v",
    "max_position_embeddings": "p",
}
_NO_KV = {"gpt2", "gpt_neox", "opt", "bloom", "bert", "t5", "vit", "falcon", "modernbert", "mamba"}


def _value(v: Any, dims: dict[str, int]) -> Any:
    if not isinstance(v, str) or not v or v[0] not in dims:
        return v
    if "/" in v:
        a, b = v.split("/")
        return dims[a] // (dims[b] if b in dims else int(b))
    return dims[v]


def config(family: str, *, h: int, l: int, a: int, k: int, f: int, v: int, p: int) -> dict[str, Any]:
    """The config.json dict of ``family`` at a size (hidden, layers, heads, kv heads, ffn, vocab, positions)."""
    model_type, arch, extra = _FAMILIES[family]
    dims = {"h": h, "l": l, "a": a, "k": k, "f": f, "v": v, "p": p}
    out: dict[str, Any] = {"model_type": model_type, "architectures": [arch]}
    if family not in ("gpt2", "t5"):
        out.update({key: _value(val, dims) for key, val in _COMMON.items()})
    if family in _NO_KV:
        out.pop("num_key_value_heads", None)
    if family in ("gpt2", "t5"):
        out["vocab_size"] = v
    if family == "bloom":
        out = {"model_type": model_type, "architectures": [arch], "hidden_size": h, "vocab_size": v}
    if family == "vit":
        for key in ("vocab_size", "max_position_embeddings"):
            out.pop(key)
    if family == "t5":
        out["d_kv"] = h // a
    out.update({key: _value(val, dims) for key, val in extra.items()})
    return out


def tiny(family: str) -> dict[str, Any]:
    """A 2-layer, hidden-64 config (trains on CPU ranks in a second)."""
    cfg = config(family, h=64, l=2, a=4, k=2, f=128, v=128, p=64)
    return {**cfg, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # inside the tiny vocabulary


def realistic(family: str) -> dict[str, Any]:
    """A hidden-2048, 16-layer config of the family (1-2B parameters; traced and compiled, never run here)."""
    cfg = config(family, h=2048, l=16, a=16, k=8, f=5632, v=32000, p=2048)
    return {**cfg, "vocab_size": 32064} if family == "phi3" else cfg  # Phi-3's vocabulary (pad id 32000)


def write_config(directory: Path, cfg: dict[str, Any]) -> Path:
    """Write ``cfg`` as ``directory/config.json``; returns the directory (a model spec)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    return directory
