"""Hugging Face models from a ``config.json``, by the ecosystem's own rules (no network, no weights).

Sits beside ``models/zoo.py``: ``resolve_model("path/config.json")`` (or a directory holding one)
lands in :func:`load`. The config goes through ``transformers.AutoConfig.for_model``
(any ``model_type`` transformers knows), the model class is the config's ``architectures[0]`` or
the Auto mapping of the task (causal LM, masked LM, seq2seq LM, image classification), and the
model is built on the meta device by ``ModelHandle.build``. When a ``model_type`` has several of
these tasks and the config names no architecture, the task is chosen with a ``#task`` suffix on
the spec (``partita trace DIR --task masked-lm`` writes it), so the launched program resolves the
same model. The model's name is the config's ``_name_or_path``, else its architecture, else the
directory name.

Training semantics shared by every parallel run and its single-device reference: dropout and
router jitter are off (a seeded run of any layout must equal the reference), ``use_cache`` is off;
example inputs per task are ``input_ids``/``labels`` (LMs), ``pixel_values``/``labels`` (images),
``input_ids``/``decoder_input_ids``/``labels`` (seq2seq; the decoder reads the labels shifted right).
The loss per task (``backends/torch/train.make_loss`` reads ``config["shift_labels"]``):

* causal LM: next-token cross-entropy (logits at position s against the token at s+1);
* masked LM: :data:`MASK_FRACTION` of each row's positions, chosen from the data seed, are replaced by
  the mask id and are the only targets (label -100 elsewhere, cross-entropy's ignore index); a fixed
  count per row keeps the global target count known before the step (every rank divides by it);
* seq2seq: the decoder's logits against the labels, position for position (no shift: the decoder
  input is already the labels shifted right, by T5's own rule: start id, then labels[:-1]);
* image classification: class-label cross-entropy of the (batch, classes) logits.

MoE models whose config asks for it (``output_router_logits``) also train on the model's own
load-balancing loss, per sequence (``models/moe_aux.py``); ``summary`` then marks them ``no_pipeline``.

A model with several inputs (seq2seq: ``input_ids`` and ``decoder_input_ids``) is fed one tensor per
batch, the inputs stacked on dim 1 (:func:`pack`: the runtime slices rows and micro-batches of one
tensor), and unpacked by a forward pre-hook the builder puts on the model (:func:`unpack_on_call`).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from partita.errors import ModelError
from partita.models import moe_aux

TASKS = ("causal-lm", "masked-lm", "seq2seq-lm", "image-classification")
_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
MASK_FRACTION = 0.15  # BERT's masking rate
IGNORE_INDEX = -100  # torch cross-entropy's default ignore_index: positions that are not targets
_DROPOUT_KEY = re.compile(r"(dropout|pdrop|drop_prob|dropout_rate|jitter_noise)")
_META_KEYS = ("model_type", "transformers_version")


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"dir/config.json#masked-lm"`` -> (path, task); no suffix -> (spec, None)."""
    path, sep, task = spec.rpartition("#")
    if sep and task in TASKS:
        return path, task
    return spec, None


def is_config_spec(spec: str) -> bool:
    """A path to a config.json (or any .json file), or a directory holding a config.json."""
    path, _ = split_spec(spec)
    p = Path(path)
    return path.endswith(".json") or p.is_file() or (p.is_dir() and (p / "config.json").is_file())


def _mapping(task: str) -> dict[str, Any]:
    import transformers.models.auto.modeling_auto as auto

    return dict(getattr(auto, _MAPPINGS[task]))


def tasks_for(model_type: str) -> list[str]:
    """The tasks of :data:`TASKS` that transformers has a model class for, for this ``model_type``."""
    return [t for t in TASKS if model_type in _mapping(t)]


def _read(path: Path) -> tuple[Path, dict[str, Any]]:
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ModelError(
            f"cannot read model config {file}: {err}",
            "pass a readable HF config.json (or the directory that holds one)",
        ) from None
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise ModelError(
            f"{file} has no model_type, so transformers cannot tell which architecture it describes",
            'add "model_type" (e.g. "llama", "qwen2", "t5") as in the config.json of a Hugging Face checkpoint',
        )
    return file, raw


def load_config(path: Path) -> tuple[Path, Any]:
    """The transformers config object of a config.json (AutoConfig by ``model_type``), dropout off."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    file, raw = _read(path)
    mt = raw["model_type"]
    if mt not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(mt, list(CONFIG_MAPPING_NAMES), n=3, cutoff=0.6)
        raise ModelError(
            f"{file} has model_type {mt!r}, which transformers {_tf_version()} does not know"
            + (f" (did you mean {', '.join(close)}?)" if close else ""),
            "fix model_type, or upgrade transformers to a version that has this architecture",
        )
    try:
        cfg = AutoConfig.for_model(mt, **{k: v for k, v in raw.items() if k not in _META_KEYS})
    except Exception as err:  # noqa: BLE001 - transformers' validators raise their own types: the config's fault
        raise ModelError(
            f"transformers rejects {file}: {type(err).__name__}: {err}", "fix the config values it names"
        ) from None
    for key, value in cfg.to_dict().items():
        if isinstance(value, float) and _DROPOUT_KEY.search(key):
            setattr(cfg, key, 0.0)  # seeded runs of every layout must equal the reference
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    return file, cfg


def _tf_version() -> str:
    import transformers

    return str(transformers.__version__)


def model_class(cfg: Any, task: str | None, file: Path) -> tuple[str, Any]:
    """(task, transformers model class): ``architectures[0]`` when it is one of the tasks, else the
    task's Auto mapping; ModelError when the model_type has several tasks and none was chosen."""
    import transformers

    named = [str(a) for a in (getattr(cfg, "architectures", None) or [])]
    archs = [a for a in named if hasattr(transformers, a)]
    for arch in archs:
        owners = [t for t in TASKS if arch in _mapping(t).values()]
        if owners and (task is None or task in owners):
            return (task or owners[0]), getattr(transformers, arch)
    mt = cfg.model_type
    have = tasks_for(mt)
    if named and task is None:  # the config names its model, and it is none Partita trains: never a substitute
        classes = [f"{_mapping(t)[mt]} ({t})" for t in have]
        why = f"{file} names architecture {named[0]}, which Partita cannot train (it trains {', '.join(TASKS)} models)"
        if classes and getattr(cfg, "is_encoder_decoder", False):
            why += (
                f"; {', '.join(classes)} is only the decoder of this encoder-decoder model, so it is not built instead"
            )
        fix = "wrap the model in a module that returns a loss and pass it as package.module:factory"
        if classes:
            fix = f'to train {", ".join(classes)}, name it in "architectures" or pass --task; or ' + fix
        raise ModelError(why, fix)
    if task is not None and task not in have:
        raise ModelError(
            f"{file}: transformers has no {task} model for model_type {mt!r}",
            f"choose one of: {', '.join(have) or 'none (this architecture has no LM or image-classification head)'}",
        )
    if task is None:
        if not have:
            raise ModelError(
                f"{file}: model_type {mt!r} has no causal-LM, masked-LM, seq2seq or image-classification model "
                "in transformers, so there is no loss to train",
                'name a training architecture in "architectures" (e.g. "...ForCausalLM"), or wrap the model in '
                "a module that returns a loss and pass it as package.module:factory",
            )
        if len(have) > 1:
            raise ModelError(
                f"{file}: model_type {mt!r} can be trained as {', '.join(have)}, and the config names no "
                "architecture to choose by",
                f'pass --task ({" | ".join(have)}), or add "architectures": ["..."] to the config',
            )
        task = have[0]
    return task, getattr(transformers, _mapping(task)[mt])


def task_of_model(model: Any) -> str | None:
    """The task of a live transformers model by its class (``BertForMaskedLM`` -> "masked-lm"), or None
    for a class of no task's Auto mapping (any other module)."""
    name = type(model).__name__
    if not type(model).__module__.startswith("transformers."):
        return None
    return next((t for t in TASKS if name in _mapping(t).values()), None)


def _first(cfg: dict[str, Any], *keys: str, default: Any = 0) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k)), default)


def summary(cfg: Any, task: str) -> dict[str, Any]:
    g = cfg.to_dict()
    experts = _first(g, "num_local_experts", "num_experts", "n_routed_experts")
    out = {
        "kind": "moe" if experts else g.get("model_type", "hf"),
        "model_type": g.get("model_type"),
        "task": task,
        "hidden": _first(g, "hidden_size", "n_embd", "d_model", "dim") or (g.get("hidden_sizes") or [0])[-1],
        "num_layers": _first(g, "num_hidden_layers", "n_layer", "num_layers") or sum(g.get("depths") or []),
        "heads": _first(g, "num_attention_heads", "n_head", "num_heads"),
        "vocab": g.get("vocab_size", 0) or 0,
        "seq_len": _first(g, "max_position_embeddings", "n_positions", "n_ctx", default=512),
        "tokens": task != "image-classification",
        "shift_labels": task == "causal-lm",
        "num_experts": experts,
    }
    if moe_aux.aux_coef(cfg) > 0:  # the load-balancing loss couples every MoE layer: one stage (models/moe_aux.py)
        out["router_aux_loss_coef"] = moe_aux.aux_coef(cfg)
        out["no_pipeline"] = moe_aux.NO_PIPELINE
    if task == "seq2seq-lm":
        out["packed_inputs"] = list(PACKED_SEQ2SEQ)
    if task == "masked-lm":  # set mask_token_id in config.json to the tokenizer's [MASK] (BERT's is 103)
        out["mask_token_id"] = mask_id_of(cfg)
    if task == "image-classification":
        size, patch = g.get("image_size", 224), g.get("patch_size")
        out["seq_len"] = (size // patch) ** 2 + 1 if patch else 0
    return out


def inputs_for(cfg: Any, task: str) -> Callable[[int, int, str], dict[str, Any]]:
    """``fn(batch, seq, device)`` -> the model's example inputs and labels for ``task``."""
    vocab = int(getattr(cfg, "vocab_size", 0) or 2)
    if task == "image-classification":
        size = int(getattr(cfg, "image_size", 224))
        chans = int(getattr(cfg, "num_channels", 3))
        labels_n = int(getattr(cfg, "num_labels", 2))

        def image(batch: int, seq: int, device: str) -> dict[str, Any]:
            if device == "meta":
                x = torch.zeros(batch, chans, size, size, device=device)
                return {"pixel_values": x, "labels": torch.zeros(batch, dtype=torch.long, device=device)}
            x = torch.randn(batch, chans, size, size, device=device)
            return {"pixel_values": x, "labels": torch.randint(0, labels_n, (batch,), device=device)}

        return image
    start = getattr(cfg, "decoder_start_token_id", None)
    start = int(start if start is not None else (getattr(cfg, "pad_token_id", None) or 0))
    mask_id = mask_id_of(cfg)

    def tokens(batch: int, seq: int, device: str) -> dict[str, Any]:
        if device == "meta":
            ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
            labels = ids.clone()
        else:
            top = vocab - 1 if task == "masked-lm" and mask_id == vocab - 1 else vocab
            ids = torch.randint(0, top, (batch, seq), device=device)
            labels = torch.randint(0, vocab, (batch, seq), device=device) if task == "seq2seq-lm" else ids.clone()
        if task == "masked-lm":
            return mask_tokens(ids, mask_id)
        if task != "seq2seq-lm":
            return {"input_ids": ids, "labels": labels}
        dec = torch.full_like(labels, start)
        dec[:, 1:] = labels[:, :-1]  # teacher forcing: the decoder reads the labels shifted right
        return {"input_ids": ids, "decoder_input_ids": dec, "labels": labels}

    return tokens


def masked_count(seq: int) -> int:
    """Masked positions per row of ``seq`` tokens: :data:`MASK_FRACTION` of them, at least one."""
    return max(1, round(MASK_FRACTION * seq))


def mask_tokens(ids: torch.Tensor, mask_id: int) -> dict[str, torch.Tensor]:
    """Masked-LM inputs of token rows ``ids``: :func:`masked_count` positions per row, drawn from the
    current torch seed (the runtime seeds each step), become ``mask_id``; labels hold the original
    token there and :data:`IGNORE_INDEX` elsewhere."""
    b, s = ids.shape
    if ids.device.type == "meta":
        return {"input_ids": ids, "labels": ids.clone()}
    where = torch.rand(b, s, device=ids.device).argsort(dim=1)[:, : masked_count(s)]
    masked = torch.zeros(b, s, dtype=torch.bool, device=ids.device).scatter_(1, where, True)
    labels = torch.where(masked, ids, torch.full_like(ids, IGNORE_INDEX))
    return {"input_ids": torch.where(masked, torch.full_like(ids, mask_id), ids), "labels": labels}


def mask_rows(ids: torch.Tensor, mask_id: int, seeds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mask_tokens` for rows read from data (a token file): row ``i``'s positions are drawn
    from a generator seeded by ``seeds[i]``, so a row is masked alike whichever rank reads it."""
    k, s = masked_count(ids.shape[1]), ids.shape[1]
    masked = torch.zeros(ids.shape, dtype=torch.bool)
    for i, seed in enumerate(seeds):
        masked[i, torch.randperm(s, generator=torch.Generator().manual_seed(int(seed)))[:k]] = True
    labels = torch.where(masked, ids, torch.full_like(ids, IGNORE_INDEX))
    return torch.where(masked, torch.full_like(ids, mask_id), ids), labels


def mask_id_of(cfg: Any) -> int:
    """The config's ``mask_token_id``, else ``vocab_size - 1`` (synthetic ids are drawn below it)."""
    got = getattr(cfg, "mask_token_id", None)
    return int(got) if got is not None else int(getattr(cfg, "vocab_size", 0) or 2) - 1


PACKED_SEQ2SEQ = ("input_ids", "decoder_input_ids")


def pack(inputs: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The model inputs ``names`` as one tensor, stacked on dim 1 (they must share shape and dtype);
    one name: that input as it is."""
    if len(names) < 2:
        return inputs[names[0]] if names else next(iter(inputs.values()))
    ts = [inputs[n] for n in names]
    if any(t.shape != ts[0].shape or t.dtype != ts[0].dtype for t in ts):
        raise ModelError(
            f"inputs {', '.join(names)} differ in shape or dtype, so they cannot travel as one batch tensor",
            "give the model inputs of one shape and dtype (e.g. pad decoder inputs to the encoder's length)",
        )
    return torch.stack(ts, dim=1)


def unpack_on_call(model: torch.nn.Module, names: Sequence[str]) -> torch.nn.Module:
    """Let ``model(x)`` take the :func:`pack` of ``names`` (a forward pre-hook splits dim 1 into the
    named keyword inputs); calls with the inputs given separately are unchanged."""

    def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        x = args[0] if len(args) == 1 and isinstance(args[0], torch.Tensor) else None
        if x is None or any(n in kwargs for n in names) or x.dim() < 3 or x.shape[1] != len(names):
            return None
        return (), {**kwargs, **{n: x[:, i] for i, n in enumerate(names)}}

    if model.__dict__.get("_partita_packed") != tuple(names):  # once per module (parallelize may run twice)
        model.register_forward_pre_hook(hook, with_kwargs=True)
        model.__dict__["_partita_packed"] = tuple(names)
    return model


def build_model(cls: Any, cfg: Any) -> torch.nn.Module:
    """``cls(cfg)`` with SDPA attention where the architecture has it (eager otherwise); a config the
    architecture rejects is a ModelError naming the class and transformers' reason."""
    err: Exception | None = None
    for impl in ("sdpa", "eager"):
        cfg._attn_implementation = impl
        try:
            return cls(cfg)
        except (ValueError, ImportError, AssertionError, TypeError, RuntimeError, ArithmeticError, KeyError) as e:
            err = e
            if "attn" not in str(e).lower() and "attention" not in str(e).lower():
                break
    raise ModelError(
        f"transformers cannot build {cls.__name__} from this config: {type(err).__name__}: {err}",
        "fix the config value it names (e.g. pad_token_id must be below vocab_size)",
    )


def model_name(raw: dict[str, Any], file: Path) -> str:
    """``_name_or_path``, else ``architectures[0]``, else the directory (or file) name."""
    name = str(raw.get("_name_or_path") or "")
    if name:
        return name.rstrip("/").rsplit("/", 1)[-1] if Path(name).exists() else name
    archs = raw.get("architectures") or []
    if archs:
        return str(archs[0])
    return file.parent.name if file.name == "config.json" and file.parent.name else file.stem


def load(spec: str) -> tuple[str, dict[str, Any], Callable[[], torch.nn.Module], Any, str]:
    """(name, summary, builder, example-inputs fn, description) of ``spec`` (config.json or its
    directory, optional ``#task``): the fields of ``zoo.ModelHandle``, which ``zoo.resolve_model`` builds."""
    path_s, task = split_spec(spec)
    file, raw = _read(Path(path_s))
    file, cfg = load_config(file)
    task, cls = model_class(cfg, task, file)
    desc = f"{cls.__name__} ({task}) from {file}"
    info = summary(cfg, task)
    names = info.get("packed_inputs") or []

    def builder() -> torch.nn.Module:
        model = build_model(cls, cfg)
        return unpack_on_call(model, names) if names else model

    return model_name(raw, file), info, builder, inputs_for(cfg, task), desc
