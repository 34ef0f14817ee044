"""The declared schema of a Hugging Face ``config.json``'s sizes, checked before transformers reads it.

Called by ``driver.py`` wherever a model spec is resolved (``trace``, ``compile``, ``evaluate``), before
``models/hf.py`` hands the file to ``transformers.AutoConfig``: transformers and the model classes
behind it check little (a ``hidden_size`` of 0 ends in a ``ZeroDivisionError`` inside
``LlamaAttention``, a string or a bool in a validator's traceback, 3 key-value heads for 4 attention
heads in a broadcast error inside ``torch.export``, a negative layer count or a vocabulary of 10^12 is
accepted). Here every size field a config may carry is a positive integer within a bound, the
attention heads divide the hidden size (unless ``head_dim`` is given) and the key-value heads divide
the attention heads; the file is a regular file of UTF-8 JSON, one object, no key twice, no NaN.
Imports neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partita.errors import ModelError

# size field -> its largest accepted value: far above any published model (vocabularies of 256k,
# hidden sizes of 32k, 128 layers), far below what would make a meta build or a trace run for ever.
SIZE_FIELDS: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim"), 1 << 18),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "n_layers"), 4096),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads"), 4096),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), 4096),
    **dict.fromkeys(("intermediate_size", "n_inner", "d_ff", "ffn_dim", "moe_intermediate_size"), 1 << 21),
    "vocab_size": 1 << 24,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 1 << 24),
    "head_dim": 1 << 14,
    **dict.fromkeys(("num_local_experts", "num_experts"), 1 << 14),
    "num_experts_per_tok": 1 << 10,
    **dict.fromkeys(("image_size", "patch_size"), 1 << 16),
    "num_channels": 1 << 12,
}
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_FIX = "pass a readable HF config.json (or the directory that holds one)"


def config_file(spec: str) -> Path | None:
    """The config.json a model spec names (``path/config.json``, a directory holding one, an optional
    ``#task``), or None for a zoo name or ``module:factory``."""
    base = spec.rpartition("#")[0] if "#" in spec else spec
    if ":" in base and not Path(base).exists():
        return None
    p = Path(base)
    if p.is_dir():
        return p / "config.json" if (p / "config.json").exists() or (p / "config.json").is_symlink() else None
    if base.endswith(".json") or p.exists() or p.is_symlink():
        return p
    return None


def check_model_spec(spec: str) -> None:
    """Refuse a spec's config.json that breaks the schema (module docstring); nothing for other specs."""
    file = config_file(spec)
    if file is None:
        return
    from partita.user_files import DuplicateKey, NonFinite, loads_json, read_user_text

    text = read_user_text(file, "model config", _FIX, ModelError, max_bytes=16 << 20)
    try:
        raw = loads_json(text)
    except DuplicateKey as e:
        raise ModelError(
            f"model config {file} names {e.args[0]!r} twice; only the last would count.", f"keep one {e.args[0]!r}."
        ) from None
    except NonFinite as e:
        raise ModelError(
            f"model config {file} holds {e.args[0]}.", "write a finite number (or remove the key)."
        ) from None
    except ValueError as e:
        raise ModelError(f"cannot read model config {file}: {e}", _FIX) from None
    check_config(raw, file)


def check_config(raw: Any, file: Path | str) -> None:
    """The schema of the module docstring on a parsed config.json."""
    if not isinstance(raw, dict):
        raise ModelError(
            f"model config {file} holds a JSON {type(raw).__name__}, not an object.",
            'a config.json is one object such as {"model_type": "llama", "hidden_size": 4096, ...}.',
        )
    mt = raw.get("model_type")
    if mt is not None and (not isinstance(mt, str) or not mt.strip()):
        raise ModelError(
            f"model config {file}: model_type is {mt!r}, not the name of an architecture.",
            'write one name, e.g. "model_type": "llama".',
        )
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs)):
        raise ModelError(
            f"model config {file}: architectures is {archs!r}, not a list of class names.",
            'write it as a list, e.g. "architectures": ["LlamaForCausalLM"], or remove it.',
        )
    for key, most in SIZE_FIELDS.items():
        if key not in raw or raw[key] is None:
            continue
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ModelError(
                f"model config {file}: {key} is {v!r}, not an integer.",
                f'write {key} as a whole number, e.g. "{key}": 8.',
            )
        if not 1 <= v <= most:
            raise ModelError(
                f"model config {file}: {key} is {v:,}; it must be a positive integer of at most {most:,}.",
                f"fix {key} (copy it from the checkpoint's own config.json).",
            )
    hidden = _first(raw, _HIDDEN)
    heads = _first(raw, _HEADS)
    kv = _first(raw, _KV_HEADS)
    if hidden and heads and raw.get("head_dim") is None and hidden[1] % heads[1]:
        near = [h for h in range(heads[1], 0, -1) if hidden[1] % h == 0][:1]
        raise ModelError(
            f"model config {file}: {heads[0]} is {heads[1]}, which does not divide {hidden[0]} {hidden[1]} "
            "(every attention head gets hidden/heads channels).",
            f"use a {heads[0]} that divides {hidden[1]} (e.g. {near[0]}), or give head_dim.",
        )
    experts = _first(raw, ("num_local_experts", "num_experts"))
    top_k = _first(raw, ("num_experts_per_tok",))
    if experts and top_k and top_k[1] > experts[1]:
        raise ModelError(
            f"model config {file}: num_experts_per_tok is {top_k[1]}, more than the {experts[1]} experts "
            f"({experts[0]}).",
            f"route each token to at most {experts[1]} experts.",
        )
    if heads and kv and heads[1] % kv[1]:
        raise ModelError(
            f"model config {file}: {kv[0]} is {kv[1]}, which does not divide {heads[0]} {heads[1]} "
            "(grouped-query attention shares each key-value head among a whole number of query heads).",
            f"use a {kv[0]} that divides {heads[1]}.",
        )


def _first(raw: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    for k in keys:
        if isinstance(raw.get(k), int):
            return k, raw[k]
    return None
