"""Model zoo: named model specs the CLI and tests can build without network or weights.

Sits beside the tracer: ``resolve_model(spec)`` turns a zoo name, a Hugging Face ``config.json``
path or a ``"package.module:factory"`` string into a :class:`ModelHandle` whose ``build()`` gives an
``nn.Module`` (on the meta device by default, so a 175B model allocates nothing) and whose
``example_inputs()`` gives the inputs ``frontends/trace_torch.py`` traces with. Hugging Face entries
are built from config classes (``transformers``), dropout off, SDPA attention.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from partita.errors import ModelError


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    framework: str
    num_params: int
    description: str


@dataclasses.dataclass
class ModelHandle:
    """A buildable model: ``build(device)`` -> module, ``example_inputs(batch, seq, device)`` -> kwargs."""

    name: str
    framework: str
    config: dict[str, Any]  # summary: kind, hidden, num_layers, heads, vocab, seq_len
    builder: Callable[[], torch.nn.Module]
    inputs_fn: Callable[[int, int, str], dict[str, Any]]
    description: str = ""
    # the same model with n repeated blocks (a shallow copy of a Hugging Face config), for
    # frontends/repeat.py: trace a few blocks, expand to the full depth
    depth_builder: Callable[[int], torch.nn.Module] | None = None

    def build(self, device: str = "meta", seed: int = 0) -> torch.nn.Module:
        if device != "meta":
            torch.manual_seed(seed)
        with torch.device(device):
            module = self.builder()
        _attach_inputs(module, self)
        return module

    def example_inputs(self, batch: int, seq: int, device: str = "meta") -> dict[str, Any]:
        return self.inputs_fn(batch, seq, device)

    def num_params(self) -> int:
        """Exact parameter count, tied weights once (built on meta: nothing allocated)."""
        return sum(p.numel() for p in self.build("meta").parameters())

    def dynamic(self, max_batch: int = 1 << 16) -> dict[str, tuple[str, int, int]]:
        """The ``trace_module(dynamic=...)`` spec for this model's inputs."""
        seq = int(self.config.get("seq_len") or 0)
        spec: dict[str, tuple[str, int, int]] = {}
        for key, t in self.example_inputs(2, max(seq, 2) if seq else 2).items():
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                spec[f"{key}:0"] = ("B", 1, max_batch)
                if self.config.get("tokens") and t.dim() == 2:
                    spec[f"{key}:1"] = ("S", 2, seq)
        return spec

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.name, self.framework, self.num_params(), self.description)


def _attach_inputs(module: torch.nn.Module, handle: ModelHandle) -> None:
    """Let the torch runtime probe the module's call order (``backends/torch/stages.py``) with the
    handle's own example inputs: stored in the instance ``__dict__``, not a parameter or submodule."""
    if isinstance(module, torch.nn.Module):
        module.__dict__["_partita_inputs"] = (handle.inputs_fn, int(handle.config.get("seq_len") or 0))


# ---- Hugging Face builders -----------------------------------------------------------------
_NO_DROPOUT = {
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "vit": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "llama": dict(attention_dropout=0.0),
    "mixtral": dict(attention_dropout=0.0, router_jitter_noise=0.0),
}


def _hf_config(kind: str, **kw: Any) -> Any:
    import transformers as T

    cls = {
        "gpt2": T.GPT2Config,
        "llama": T.LlamaConfig,
        "mixtral": T.MixtralConfig,
        "bert": T.BertConfig,
        "vit": T.ViTConfig,
        "resnet": T.ResNetConfig,
    }[kind]
    cfg = cls(**{**_NO_DROPOUT.get(kind, {}), **kw})
    if kind in ("gpt2", "llama", "mixtral"):
        cfg.use_cache = False
        cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None
    return cfg


def _hf_model(kind: str, cfg: Any) -> torch.nn.Module:
    import transformers as T

    cls = {
        "gpt2": T.GPT2LMHeadModel,
        "llama": T.LlamaForCausalLM,
        "mixtral": T.MixtralForCausalLM,
        "bert": T.BertForMaskedLM,
        "vit": T.ViTForImageClassification,
        "resnet": T.ResNetForImageClassification,
    }[kind]
    if kind != "resnet":
        # HF's own config key picks the attention kernel; "eager" traces the unfused
        # matmul-softmax-dropout-matmul that Megatron-LM ran before flash attention.
        cfg._attn_implementation = getattr(cfg, "_attn_implementation_internal", None) or "sdpa"
    return cls(cfg)


def _token_inputs(vocab: int) -> Callable[[int, int, str], dict[str, Any]]:
    def fn(batch: int, seq: int, device: str) -> dict[str, Any]:
        if device == "meta":
            ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        else:
            ids = torch.randint(0, vocab, (batch, seq), device=device)
        return {"input_ids": ids, "labels": ids.clone()}

    return fn


def _image_inputs(size: int, num_labels: int) -> Callable[[int, int, str], dict[str, Any]]:
    def fn(batch: int, seq: int, device: str) -> dict[str, Any]:
        maker = torch.zeros if device == "meta" else torch.randn
        labels = torch.zeros(batch, dtype=torch.long, device=device)
        if device != "meta":
            labels = torch.randint(0, num_labels, (batch,), device=device)
        return {"pixel_values": maker(batch, 3, size, size, device=device), "labels": labels}

    return fn


def _hf_handle(name: str, kind: str, description: str, **kw: Any) -> ModelHandle:
    cfg = _hf_config(kind, **kw)
    g = cfg.to_dict()
    hidden = g.get("hidden_size") or g.get("n_embd") or (g.get("hidden_sizes") or [0])[-1]
    summary = {
        "kind": {"gpt2": "gpt", "mixtral": "moe"}.get(kind, kind),
        "hidden": hidden,
        "num_layers": g.get("num_hidden_layers") or g.get("n_layer") or sum(g.get("depths", [])),
        "heads": g.get("num_attention_heads") or g.get("n_head") or 0,
        "vocab": g.get("vocab_size", 0),
        "seq_len": g.get("max_position_embeddings") or g.get("n_positions") or 0,
        "tokens": kind in ("gpt2", "llama", "mixtral", "bert"),
    }
    if kind in ("vit", "resnet"):
        size = g.get("image_size", 224)
        inputs = _image_inputs(size, g.get("num_labels", 2))
        summary["seq_len"] = (size // g["patch_size"]) ** 2 + 1 if kind == "vit" else 0
    else:
        inputs = _token_inputs(summary["vocab"])
    depth = None if kind == "resnet" else (lambda n: _hf_model(kind, _with_depth(cfg, n)))
    return ModelHandle(name, "torch", summary, lambda: _hf_model(kind, cfg), inputs, description, depth)


def _with_depth(cfg: Any, num_layers: int) -> Any:
    """A shallow copy of ``cfg`` with ``num_layers`` blocks (every HF config here maps
    ``num_hidden_layers``; GPT-2 to ``n_layer``)."""
    out = copy.copy(cfg)
    out.num_hidden_layers = num_layers
    return out


def _gpt3(name: str, hidden: int, layers: int, heads: int) -> Callable[[], ModelHandle]:
    return lambda: _hf_handle(
        name,
        "gpt2",
        f"GPT-3 {name.split('-')[1].upper()} shape on the GPT-2 architecture (h={hidden}, l={layers}, heads={heads})",
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        vocab_size=51200,
        n_positions=2048,
    )


# ---- a plain torch model -------------------------------------------------------------------
class MLP(torch.nn.Module):
    """Two-layer MLP classifier with a cross-entropy loss (used by runtime tests)."""

    def __init__(self, in_dim: int = 32, hidden: int = 64, num_classes: int = 8) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(in_dim, hidden)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.fc2(self.act(self.fc1(x)))
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits, labels)


def mlp_factory() -> tuple[torch.nn.Module, Callable[[int, int, str], dict[str, Any]]]:
    """Example of the ``"package.module:factory"`` form: ``partita.models.zoo:mlp_factory``."""
    return MLP(), _mlp_inputs


def _mlp_inputs(batch: int, seq: int, device: str) -> dict[str, Any]:
    if device == "meta":
        return {
            "x": torch.zeros(batch, 32, device=device),
            "labels": torch.zeros(batch, dtype=torch.long, device=device),
        }
    return {"x": torch.randn(batch, 32, device=device), "labels": torch.randint(0, 8, (batch,), device=device)}


def _mlp() -> ModelHandle:
    summary = {"kind": "mlp", "hidden": 64, "num_layers": 2, "heads": 0, "vocab": 0, "seq_len": 0, "tokens": False}
    return ModelHandle("mlp", "torch", summary, MLP, _mlp_inputs, "2-layer MLP (32 -> 64 -> 8) with cross-entropy")


_TINY = dict(vocab_size=128, max_position_embeddings=32)
_FACTORIES: dict[str, Callable[[], ModelHandle]] = {
    "gpt2": lambda: _hf_handle("gpt2", "gpt2", "GPT-2 small, 124M", n_positions=1024),
    "gpt3-1.3b": _gpt3("gpt3-1.3b", 2048, 24, 16),
    "gpt3-2.7b": _gpt3("gpt3-2.7b", 2560, 32, 32),
    "gpt3-6.7b": _gpt3("gpt3-6.7b", 4096, 32, 32),
    "gpt3-13b": _gpt3("gpt3-13b", 5120, 40, 40),
    "gpt3-39b": _gpt3("gpt3-39b", 8192, 48, 64),
    "gpt3-175b": _gpt3("gpt3-175b", 12288, 96, 96),
    "llama-7b": lambda: _hf_handle(
        "llama-7b",
        "llama",
        "Llama-2 7B",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama-70b": lambda: _hf_handle(
        "llama-70b",
        "llama",
        "Llama-2 70B (GQA, 8 kv heads)",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "mixtral-8x7b": lambda: _hf_handle(
        "mixtral-8x7b",
        "mixtral",
        "Mixtral 8x7B MoE (8 experts, top-2)",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "bert-large": lambda: _hf_handle(
        "bert-large",
        "bert",
        "BERT-large MLM, 336M",
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
    ),
    "vit-huge": lambda: _hf_handle(
        "vit-huge",
        "vit",
        "ViT-H/14 classifier, 632M",
        hidden_size=1280,
        num_hidden_layers=32,
        num_attention_heads=16,
        intermediate_size=5120,
        image_size=224,
        patch_size=14,
        num_labels=1000,
    ),
    "resnet-50": lambda: _hf_handle(
        "resnet-50",
        "resnet",
        "ResNet-50 (bottleneck, 3-4-6-3), 25.6M",
        embedding_size=64,
        hidden_sizes=[256, 512, 1024, 2048],
        depths=[3, 4, 6, 3],
        layer_type="bottleneck",
        num_labels=1000,
    ),
    "gpt2-tiny": lambda: _hf_handle(
        "gpt2-tiny",
        "gpt2",
        "test GPT-2: 2 layers, h=64, 4 heads",
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=128,
        n_positions=32,
    ),
    "llama-tiny": lambda: _hf_handle(
        "llama-tiny",
        "llama",
        "test Llama: 2 layers, h=64, GQA 4/2 heads",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **_TINY,
    ),
    "mixtral-tiny": lambda: _hf_handle(
        "mixtral-tiny",
        "mixtral",
        "test Mixtral: 2 layers, h=64, 4 experts top-2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        **_TINY,
    ),
    "mlp": _mlp,
}
_INFOS: dict[str, ModelInfo] = {}


def register_model(name: str, handle_factory: Callable[[], Any], info: ModelInfo) -> None:
    """Add a zoo entry (the JAX front end registers ``jax-gpt-tiny`` this way)."""
    _FACTORIES[name] = handle_factory
    _INFOS[name] = info


def register_jax_models() -> list[str]:
    """Register the JAX entries of ``models/jax_gpt.py`` (``jax-gpt-tiny``, ``jax-mlp``); importing jax
    costs seconds, so the zoo calls this lazily. Returns the names registered."""
    from partita.models.jax_gpt import jax_entries

    names = []
    for factory, description in jax_entries():
        handle = factory()
        register_model(handle.name, factory, ModelInfo(handle.name, "jax", handle.num_params(), description))
        names.append(handle.name)
    return names


def _register_jax_models() -> None:
    if "jax-gpt-tiny" not in _FACTORIES:
        register_jax_models()


def list_models() -> list[ModelInfo]:
    _register_jax_models()
    out = []
    for name, factory in _FACTORIES.items():
        if name not in _INFOS:
            _INFOS[name] = factory().info
        out.append(_INFOS[name])
    return out


def resolve_model(spec: str) -> ModelHandle:
    """A zoo name, a path to a HF ``config.json``, or ``"package.module:factory"``."""
    if spec.startswith("jax-"):
        _register_jax_models()
    if spec in _FACTORIES:
        return _FACTORIES[spec]()
    from partita.models import hf

    if hf.is_config_spec(spec):
        name, summary, builder, inputs_fn, description = hf.load(spec)
        return ModelHandle(name, "torch", summary, builder, inputs_fn, description)
    if ":" in spec:
        return _from_factory(spec)
    close = difflib.get_close_matches(spec, list(_FACTORIES), n=3, cutoff=0.4)
    raise ModelError(
        f"unknown model {spec!r}" + (f"; did you mean {', '.join(close)}?" if close else ""),
        f"use a zoo name ({', '.join(_FACTORIES)}), a Hugging Face config.json (or its directory), or "
        "'package.module:factory'",
    )


def _from_factory(spec: str) -> ModelHandle:
    mod_name, _, fn_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise ModelError(f"cannot load model factory {spec!r}: {err}", "check the module path and name") from None
    try:
        probe = factory()
    except Exception as e:  # noqa: BLE001 - any error in user code: name it, no traceback
        raise ModelError(
            f"model factory {spec!r} raised {type(e).__name__}: {e}",
            "fix the factory so that calling it with no arguments returns an nn.Module "
            "(or (module, example_inputs_fn))",
        ) from None
    shape = "return (module, example_inputs_fn) where example_inputs_fn(batch, seq, device) -> dict"
    if isinstance(probe, tuple):
        if len(probe) != 2 or not isinstance(probe[0], torch.nn.Module):
            got = ", ".join(type(x).__name__ for x in probe)
            raise ModelError(f"factory {spec!r} returned a tuple of ({got}), not (nn.Module, example_inputs_fn)", shape)
        inputs_fn = probe[1]
        builder: Callable[[], torch.nn.Module] = lambda: factory()[0]  # noqa: E731
    else:
        inputs_fn = getattr(probe, "example_inputs", None)
        builder = factory
        if not isinstance(probe, torch.nn.Module):
            raise ModelError(f"factory {spec!r} returned a {type(probe).__name__}, not an nn.Module", shape)
        if inputs_fn is None:
            raise ModelError(f"factory {spec!r} returned a module without example inputs", shape)
    summary = {"kind": "custom", "hidden": 0, "num_layers": 0, "heads": 0, "vocab": 0, "seq_len": 0}
    return ModelHandle(spec, "torch", summary, builder, _adapt_inputs(inputs_fn), f"user factory {spec}")


def _adapt_inputs(fn: Callable[..., Mapping[str, Any]]) -> Callable[[int, int, str], dict[str, Any]]:
    return lambda batch, seq, device: dict(fn(batch, seq, device))


# ---- an in-memory module (``partita.parallelize(model, ...)``) ------------------------------
@dataclasses.dataclass
class ModuleHandle(ModelHandle):
    """A user's live ``nn.Module`` as a handle: ``build("meta")`` is a weightless copy to trace.

    The copy shares no storage with the user's module: every parameter and buffer is replaced by a
    meta tensor of the same shape and dtype through ``copy.deepcopy``'s memo (tied parameters stay
    tied), so nothing the size of the weights is allocated. ``identity()`` keys the compile cache
    on what decides the traced graph: the class, its source file, ``repr(module)``, every parameter
    and buffer's shape and dtype, and the example inputs' shapes.
    """

    module: torch.nn.Module | None = None

    def build(self, device: str = "meta", seed: int = 0) -> torch.nn.Module:
        assert self.module is not None
        if device != "meta":
            _attach_inputs(self.module, self)
            return self.module  # the user's weights, not a re-initialisation
        import copy

        memo: dict[int, Any] = {}
        for _, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in self.module.buffers():
            memo.setdefault(id(b), torch.empty_like(b, device="meta"))
        return copy.deepcopy(self.module, memo)

    def identity(self) -> str:
        import hashlib
        import inspect

        assert self.module is not None
        cls = type(self.module)
        try:
            source = hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()[:16]
        except (OSError, TypeError):
            source = "unknown"
        tensors = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.module.named_parameters(remove_duplicate=False)]
        tensors += [(n, tuple(b.shape), str(b.dtype)) for n, b in self.module.named_buffers()]
        inputs = {k: (tuple(v.shape), str(v.dtype)) for k, v in self.example_inputs(2, 2).items()}
        payload = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "source": source,
            "repr": repr(self.module),
            "tensors": tensors,
            "inputs": {k: inputs[k] for k in sorted(inputs)},
        }
        return json.dumps(payload, sort_keys=True, default=str)


def _forward_names(module: torch.nn.Module) -> list[str]:
    import inspect

    try:
        ps = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _sample_inputs(samples: Mapping[str, torch.Tensor]) -> Callable[[int, int, str], dict[str, Any]]:
    """Zero tensors shaped like ``samples`` with dim 0 = batch (and dim 1 = seq for 2-D integer inputs)."""

    def fn(batch: int, seq: int, device: str) -> dict[str, Any]:
        out = {}
        for k, t in samples.items():
            shape = [batch, *t.shape[1:]]
            if t.dim() == 2 and not t.is_floating_point() and seq:
                shape[1] = seq
            out[k] = torch.zeros(shape, dtype=t.dtype, device=device)
        return out

    return fn


def module_handle(module: torch.nn.Module, example_inputs: Any = None, name: str | None = None) -> ModuleHandle:
    """A handle for a live module. ``example_inputs``: a tensor (the first forward argument), a tuple
    of tensors (positional), a dict ``{arg: tensor}`` (any batch size; only shapes and dtypes are
    used), or ``fn(batch, seq, device) -> dict``. ``None`` works for Hugging Face token models
    (``config.vocab_size``): ``input_ids`` and ``labels`` of shape (batch, seq)."""
    if not isinstance(module, torch.nn.Module):
        raise ModelError(
            f"partita.parallelize got a {type(module).__name__}, not a torch.nn.Module.",
            "pass the model object (for JAX, use @partita.parallelize(...) on the loss function).",
        )
    names = _forward_names(module)
    cfg = getattr(module, "config", None)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if callable(example_inputs) and not isinstance(example_inputs, torch.Tensor):
        inputs_fn = _adapt_inputs(example_inputs)
    elif example_inputs is None and vocab and getattr(cfg, "is_encoder_decoder", False):
        from partita.models import hf  # T5-style: the decoder's inputs too (labels shifted right)

        inputs_fn = hf.inputs_for(cfg, "seq2seq-lm")
    elif example_inputs is None and vocab:
        inputs_fn = _token_inputs(vocab)
    elif example_inputs is None:
        raise ModelError(
            f"partita.parallelize cannot tell what {type(module).__name__}.forward takes.",
            "pass example_inputs=x (one batch of the first forward argument, any batch size), or a dict "
            "{'x': x, 'labels': y} of forward arguments.",
        )
    else:
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if isinstance(example_inputs, (tuple, list)):
            if len(example_inputs) > len(names):
                raise ModelError(
                    f"{len(example_inputs)} example inputs for forward({', '.join(names)}).",
                    "pass a dict {argument name: tensor}.",
                )
            example_inputs = dict(zip(names, example_inputs))
        if not isinstance(example_inputs, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in example_inputs.values()
        ):
            raise ModelError(
                "example_inputs must be a tensor, a tuple or dict of tensors, or fn(batch, seq, device) -> dict.",
                "pass e.g. example_inputs={'x': x, 'labels': y}.",
            )
        inputs_fn = _sample_inputs(dict(example_inputs))
    kind = "gpt" if type(module).__name__.startswith("GPT2") else "custom"
    seq = int(getattr(cfg, "n_positions", 0) or getattr(cfg, "max_position_embeddings", 0) or 0)
    summary = {"kind": kind, "hidden": 0, "num_layers": 0, "heads": 0, "vocab": vocab, "seq_len": seq}
    if getattr(cfg, "is_encoder_decoder", False):  # the runtime feeds both inputs stacked on dim 1 (models/hf.py)
        from partita.models import hf

        if [k for k in inputs_fn(1, 2, "meta") if k != "labels"] == list(hf.PACKED_SEQ2SEQ):
            summary["packed_inputs"] = list(hf.PACKED_SEQ2SEQ)
            hf.unpack_on_call(module, hf.PACKED_SEQ2SEQ)
    label = name or f"{type(module).__name__}(user module)"
    return ModuleHandle(label, "torch", summary, lambda: module, inputs_fn, f"in-memory {label}", module=module)
