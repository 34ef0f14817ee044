"""Pipeline stages of any module tree, cut where the traced graph's layers are: no attribute names assumed.

Sits under ``backends/torch/parallel.py``, which sends every model without a hand adapter (the
adapters cover the zoo's GPT-2 and Llama) here: ``split_stage``, ``layer_paths`` and
``boundary_shapes`` of the generated program end up in :func:`split`, :func:`group_paths` and
:func:`boundary_shapes`.

The plan's layers come from the traced graph's module paths (``passes/layers.py``): blocks are
module paths (``model.layers.3``, ``blocks.0``, or top-level children when the model has no
repeated container), ``embed`` is what runs before the first block, ``head`` what runs after the
last. A stage does not re-implement the model's forward: it runs the model's own ``forward``
(masks, rotary tables, residuals and all) with the modules it does not own swapped out:

* **units**: each block, and each outermost parameter-holding module outside the blocks; the
  latter belong to ``embed`` / ``head`` / the block running before them by the *order the model
  calls them in*, recorded by one probe forward (:func:`probe`, the same order the tracer saw);
* a unit of another stage becomes a :class:`Ghost` (no parameters, so FQNs of the kept ones are the
  full model's): one that runs before this stage's first block computes shapes on the meta device
  and returns zeros; the block just before this stage returns the activation received from the
  previous stage instead (the block's own output structure, filled with the received tensor);
* the stage ends after its last unit: the first ghost called after it stops the forward
  (:class:`_StageDone`) and the stage returns that unit's output, the boundary tensor.

A boundary is the one tensor a block passes to the next (pipelining needs fixed per-sample
shapes); a block output with several tensors (T5 carries its position bias from block to block)
cannot be cut there and is refused with a :class:`~partita.errors.PlanError`. Later stages read the
model's raw inputs only for shapes (masks, position ids): they get zeros of the probed shape.
Extra model inputs (``decoder_input_ids``) reach a single-stage plan in the batch tensor (the inputs
stacked on dim 1, ``models/hf.py``'s ``pack``, which the model's own pre-hook unpacks), or through
:meth:`GenericStage.feed`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from partita.errors import PlanError
from partita.frontends import torch_shim

pytree = torch_shim.pytree()

GROUPS = ("embed", "head")
_PROBE, _INPUTS = "_partita_probe", "_partita_inputs"


_SAVED_OPS = (  # as parallel.py's selective recompute: matmuls and tp collectives are kept
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    *torch_shim.functional_collective_ops(),
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _StageDone(Exception):
    """Raised by the first unit of a later stage: this stage's part of the forward is over."""


def attach_inputs(module: nn.Module, fn: Callable[[int, int, str], dict[str, Any]], seq: int) -> None:
    """Remember how to make example inputs for ``module`` (``ModelHandle.build`` calls this)."""
    module.__dict__[_INPUTS] = (fn, seq)


def _blocks(layers: Sequence[str]) -> list[str]:
    return [n for n in layers if n not in GROUPS]


def _inside(path: str, paths: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in paths)


def candidate_units(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    """Outermost modules holding parameters that neither are, contain, nor sit inside a block."""
    out: list[str] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        for name, child in mod.named_children():
            path = f"{prefix}{name}"
            if path in blocks or _inside(path, blocks):
                continue
            if any(b.startswith(path + ".") for b in blocks):
                walk(child, path + ".")
            elif any(True for _ in child.parameters()):
                out.append(path)

    walk(model, "")
    return out


def _example(model: nn.Module, x: torch.Tensor | None) -> dict[str, Any]:
    got = model.__dict__.get(_INPUTS)
    if got is None:
        if x is None:
            raise PlanError(
                f"{type(model).__name__} was not built by a model handle, so its stages cannot be probed.",
                "build the model with partita.models.resolve_model(spec).build(...).",
            )
        return {"__x__": x}
    fn, seq = got
    names = [k for k in fn(1, 2, "meta") if k != "labels"]
    packed = x is not None and len(names) > 1 and x.dim() == 3 and x.shape[1] == len(names)  # models/hf.py pack
    if x is not None and not x.is_floating_point() and (x.dim() == 2 or packed):
        seq = int(x.shape[-1])
    else:
        seq = min(seq or 8, 8)
    device = str(x.device) if x is not None else str(next(model.parameters()).device)
    inputs = {k: v for k, v in fn(1, seq, device).items() if k != "labels"}
    if packed:
        assert x is not None
        inputs.update({n: x[:, i] for i, n in enumerate(names)})
    elif x is not None:
        inputs[names[0]] = x
    return inputs


def _call(model: nn.Module, inputs: Mapping[str, Any]) -> Any:
    if "__x__" in inputs:
        return model(inputs["__x__"])
    first, *rest = inputs
    return model(inputs[first], **{k: inputs[k] for k in rest})


def probe(model: nn.Module, layers: Sequence[str], x: torch.Tensor | None = None) -> dict[str, Any]:
    """One no-grad forward recording the order modules are called in and each block's output.

    Returns (and caches on ``model``) ``{"units": {plan layer: [unit paths]}, "treespec": {block:
    output structure}, "leaves": {block: [(per-sample shape, dtype)]}, "first_input": (shape,
    dtype) of block 0's input, "inputs": {name: (per-sample shape, dtype)}, "output": (shape, dtype)}``.
    """
    cached = model.__dict__.get(_PROBE)
    if cached is not None and cached["layers"] == tuple(layers):
        return cached
    blocks = _blocks(layers)
    for b in blocks:
        _submodule(model, b)
    units = candidate_units(model, blocks)
    events: list[tuple[str, str]] = []
    info: dict[str, Any] = {"treespec": {}, "leaves": {}, "first_input": None, "carried": {}}
    last_out: dict[str, list[Any]] = {}
    handles = []

    def pre(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            events.append(("pre", path))
            if path in blocks and blocks.index(path) > 0:  # which outputs of the block before it flow in
                given = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                prev = blocks[blocks.index(path) - 1]
                info["carried"][prev] = [i for i, t in enumerate(last_out.get(prev, [])) if id(t) in given]
            if path == (blocks[0] if blocks else None) and info["first_input"] is None:
                t = _hidden_arg(args, kwargs)
                info["first_input"] = (tuple(t.shape[1:]), t.dtype)

        return hook

    def post(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            events.append(("post", path))
            if path in blocks and path not in info["treespec"]:
                leaves, spec = pytree.tree_flatten(out)
                last_out[path] = leaves
                info["treespec"][path] = spec
                info["leaves"][path] = [
                    (tuple(t.shape[1:]), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves
                ]

        return hook

    for path in [*blocks, *units]:
        mod = _submodule(model, path)
        handles.append(mod.register_forward_pre_hook(pre(path), with_kwargs=True))
        handles.append(mod.register_forward_hook(post(path)))
    inputs = _example(model, x)
    try:
        with torch.no_grad():
            out = _call(model, inputs)
    finally:
        for h in handles:
            h.remove()
    logits = _logits(out)
    first = next((i for i, (k, p) in enumerate(events) if k == "pre" and p in blocks), len(events))
    last = max((i for i, (k, p) in enumerate(events) if k == "post" and p in blocks), default=-1)
    owner: dict[str, list[str]] = {name: [] for name in layers}
    for u in units:
        seen = [i for i, (k, p) in enumerate(events) if p == u and k == "pre"]
        if not seen or seen[0] < first:
            where = "embed" if "embed" in owner else (blocks[0] if blocks else layers[0])
        elif seen[0] > last:
            where = "head" if "head" in owner else blocks[-1]
        else:  # called between blocks: part of the block running before it (as the tracer assigns it)
            where = next(p for k, p in reversed(events[: seen[0]]) if k == "pre" and p in blocks)
        if seen and any((i < first) != (seen[0] < first) or (i > last) != (seen[0] > last) for i in seen):
            where = "*"  # used on both sides of the blocks: every stage needs it (refused for pipelines)
        owner.setdefault(where, []).append(u)
    info.update(
        # the unit modules as probed: a stage builder that already dropped another stage's units
        # (materialize.py puts nn.Identity there) still has their structure for its ghosts (meta)
        modules={p: _submodule(model, p) for p in [*blocks, *units]},
        layers=tuple(layers),
        units=owner,
        inputs={k: (tuple(v.shape[1:]), v.dtype) for k, v in inputs.items() if isinstance(v, torch.Tensor)},
        output=(tuple(logits.shape[1:]), logits.dtype),
    )
    model.__dict__[_PROBE] = info
    return info


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise PlanError(
        f"the model returned a {type(out).__name__}, not a tensor or an output with .logits.",
        "return the logits (or a tensor the loss reads) from forward.",
    )


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    t = kwargs.get("hidden_states", next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None))
    if t is None:
        raise PlanError("a block is called without a tensor argument.", "pass the activation to each block.")
    return t


def _submodule(model: nn.Module, path: str) -> nn.Module:
    mod = model
    for item in path.split("."):
        child = mod._modules.get(item)
        if child is None:
            raise PlanError(
                f"plan layer {path!r} names a module {type(model).__name__} does not have.",
                "recompile the plan for this model (`partita compile MODEL ...`).",
            )
        mod = child
    return mod


def group_paths(model: nn.Module, name: str, layers: Sequence[str], probe_ok: bool = True) -> tuple[str, ...]:
    """Module paths plan layer ``name`` owns: a block is its path; ``embed``/``head`` the probed units
    (without a probe: units registered before / after the first block, which is what the emitter's
    facts use on a meta model)."""
    if name not in GROUPS:
        return (name,)
    try:
        if not probe_ok:
            raise LookupError
        info = probe(model, layers)
    except Exception:  # noqa: BLE001 - emit-time facts on a meta model: registration order instead
        blocks = _blocks(layers)
        units = candidate_units(model, blocks)
        order = [p for p, _ in model.named_modules()]
        first = min((order.index(b) for b in blocks), default=len(order))
        return tuple(u for u in units if (order.index(u) < first) == (name == "embed"))
    return tuple(info["units"].get(name, ()))


def guess_blocks(model: nn.Module) -> list[str]:
    """The repeated container's blocks from the module tree alone (the numeric-path pattern with the
    most members, as ``passes/layers.py`` picks it from the graph); [] when there is none."""
    groups: dict[str, list[str]] = {}
    for path, mod in model.named_modules():
        parts = path.split(".")
        owners = sum(1 for m in mod.modules() if any(True for _ in m.parameters(recurse=False)))
        if parts[-1].isdigit() and owners >= 2:  # a block holds several layers (the tracer: >= 8 nodes)
            groups.setdefault(".".join("*" if p.isdigit() else p for p in parts), []).append(path)
    best = max(groups.items(), key=lambda kv: (len(kv[1]), -kv[0].count(".")), default=None)
    return best[1] if best and len(best[1]) >= 2 else []


def layer_paths(model: nn.Module, name: str) -> tuple[str, ...]:
    """:func:`group_paths` with the plan layers of the last probe (else the guessed container)."""
    info = model.__dict__.get(_PROBE)
    if info is not None:
        return group_paths(model, name, info["layers"])
    if name not in GROUPS:
        return (name,)
    blocks = guess_blocks(model)
    return group_paths(model, name, ["embed", *blocks, "head"], probe_ok=False) if blocks else ()


class Ghost(nn.Module):
    """Stands in for a unit of another stage: no parameters; returns zeros shaped like its output
    (computed on the meta device), or the received activation when it is the block just before
    this stage. Called after this stage's last unit, it ends the stage's forward."""

    def __init__(self, module: nn.Module, path: str, stage: GenericStage) -> None:
        super().__init__()
        self.__dict__["_shadow"] = module.to("meta")  # unregistered: its (meta) parameters are not ours
        self.__dict__["_stage"] = stage
        self.path = path

    def __getattr__(self, name: str) -> Any:  # the model reads attributes of it (ViT: a weight's dtype)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_shadow"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stage: GenericStage = self.__dict__["_stage"]
        if stage._done:
            raise _StageDone
        if self.path in stage._inject_after:
            return stage._received_output(self.path)
        if self.path in stage._ghost_blocks:
            return stage._received_output(stage._inject_from)  # earlier blocks: any value of that structure

        def to_meta(t: Any) -> Any:
            return t.detach().to("meta") if isinstance(t, torch.Tensor) else t

        out = self.__dict__["_shadow"](*pytree.tree_map(to_meta, args), **pytree.tree_map(to_meta, kwargs))
        return pytree.tree_map(
            lambda t: torch.zeros(t.shape, dtype=t.dtype, device=stage._device) if isinstance(t, torch.Tensor) else t,
            out,
        )


class GenericStage(nn.Module):
    """One stage of any model: the model's children (FQNs unchanged), its own forward, units of
    other stages as :class:`Ghost`; ``forward(x)``: stage 0 takes the first model input, later stages
    the previous stage's boundary tensor; returns this stage's boundary tensor (the logits at the end)."""

    def __init__(
        self, model: nn.Module, layers: Sequence[str], all_layers: Sequence[str], device: torch.device
    ) -> None:
        super().__init__()
        for name, child in model.named_children():
            self._modules[name] = child  # not add_module: a child may be called `blocks`, `layers`, ...
        if "blocks" in self._modules:  # the program calls module.blocks(): answer it on the child
            _answer_blocks(self._modules["blocks"], self)
        own = dict(model.named_parameters(recurse=False))
        if own and list(layers) != list(all_layers):
            raise PlanError(
                f"{type(model).__name__} holds parameters {sorted(own)} directly, outside any submodule, so no "
                "pipeline stage can own them.",
                f"move them into a submodule of {type(model).__name__}, or compile without pipeline stages.",
            )
        self._parameters.update(own)  # single stage: the same objects under the same FQNs
        self.__dict__["_root"] = model
        # Plain attributes go to __dict__: nn.Module.__setattr__ would refuse a name a child already has.
        self.__dict__.update(config=getattr(model, "config", None), arch=type(model).__name__, recompute="none")
        self.__dict__["plan_layers"] = tuple(layers)
        self._device = torch.device(device)
        info = probe(model, all_layers)
        self._info = info
        blocks = _blocks(all_layers)
        mine = set(layers)
        idx = [i for i, n in enumerate(all_layers) if n in mine]
        self.__dict__.update(first=idx[0] == 0, last=idx[-1] == len(all_layers) - 1)
        shared = info["units"].get("*", [])
        if shared and not (self.first and self.last):
            raise PlanError(
                f"{self.arch} calls {shared} both before and after its blocks, so no pipeline stage can own them.",
                "compile this model without pipeline stages (one stage), or untie that module.",
            )
        keep = {p for n in layers for p in (n,) if n not in GROUPS} | {
            u for n in layers for u in info["units"].get(n, ())
        }
        keep |= set(shared)
        before = [b for b in blocks if all_layers.index(b) < idx[0]]
        self._ghost_blocks = set(before)
        self._inject_from = before[-1] if before else None
        self._inject_after = {self._inject_from} if before else set()
        self._inject_into = blocks[0] if (not self.first and not before) else None
        self._received: torch.Tensor | None = None
        self._captured: Any = None
        self._done = False
        self._feed: list[dict[str, Any]] = []
        self._calls = 0
        if len(info["inputs"]) > 1 and not (self.first and self.last):
            raise PlanError(
                f"{self.arch} takes {len(info['inputs'])} inputs ({', '.join(info['inputs'])}); pipeline "
                "stages after the first see only the boundary activation.",
                "compile without pipeline stages for this model (one stage with dp/tp/ZeRO).",
            )
        if not self.first:
            self._check_cut(self._inject_from)
        tail = [n for n in all_layers[idx[-1] :] if n in mine]
        self._end = None if self.last else (_blocks(tail)[-1] if _blocks(tail) else "embed")
        if self._end and self._end != "embed":
            self._check_cut(self._end)
        for path in [*blocks, *(u for n, us in info["units"].items() for u in us)]:
            if path in keep:
                continue
            parent, _, attr = path.rpartition(".")
            owner = _submodule(model, parent) if parent else model
            current = _submodule(model, path)
            if isinstance(current, nn.Identity) and path in info["modules"]:
                current = info["modules"][path]  # dropped before this split: the probed module (meta)
            owner._modules[attr] = Ghost(current, path, self)
            if not parent:
                self._modules[attr] = owner._modules[attr]
        for b in blocks:
            if b in keep:
                self._wrap_block(b)
        if self._inject_into:
            _submodule(model, self._inject_into).register_forward_pre_hook(self._inject_input, with_kwargs=True)
        if self._end == "embed":
            _submodule(model, blocks[0]).register_forward_pre_hook(self._capture_input, with_kwargs=True, prepend=True)
        self.to(self._device)

    # ---- torch.nn.Module API with children registered under any name -------------------------------
    def get_submodule(self, target: str) -> nn.Module:
        return self if target == "" else _submodule(self, target)

    def stage_blocks(self) -> list[nn.Module]:
        """The stage's block modules (FSDP units), in plan order (``module.blocks()`` in the program)."""
        return [_submodule(self, n) for n in self.plan_layers if n not in GROUPS]

    def __getattr__(self, name: str) -> Any:
        if name == "blocks" and "blocks" not in self.__dict__.get("_modules", {}):
            return self.stage_blocks
        return super().__getattr__(name)

    def feed(self, inputs: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """This step's extra model inputs per micro-batch (beyond the first), used in call order."""
        self._feed, self._calls = [dict(i) for i in inputs], 0

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._done, self._captured = False, None
        if self.first:
            inputs = {**self._extras(), "__first__": x}
        else:
            self._received = x
            n = x.shape[0]
            inputs = {k: torch.zeros((n, *s), dtype=d, device=x.device) for k, (s, d) in self._info["inputs"].items()}
            inputs["__first__"] = inputs.pop(next(iter(self._info["inputs"])))
        root = self.__dict__["_root"]
        first = inputs.pop("__first__")
        try:
            out = root(first, **inputs)
        except _StageDone:
            return self._captured
        finally:
            self._received = None
        if self._end is not None:
            return self._captured
        return _logits(out)

    def _extras(self) -> dict[str, Any]:
        if not self._feed:
            return {}
        got = self._feed[self._calls % len(self._feed)]
        self._calls += 1
        return got

    def _received_output(self, block: str | None) -> Any:
        """Block ``block``'s output structure: the received tensor where the boundary leaf is, zeros of
        the probed shape for the other tensors (outputs the next block does not read, e.g. attention
        weights), non-tensors as probed."""
        assert self._received is not None
        spec, metas = self._info["treespec"][block], self._info["leaves"][block]
        at, n = boundary_leaf(self._info, block), self._received.shape[0]
        leaves = [
            self._received if i == at else (torch.zeros((n, *m[0]), dtype=m[1], device=self._device) if m else None)
            for i, m in enumerate(metas)
        ]
        return pytree.tree_unflatten(leaves, spec)

    def _check_cut(self, block: str | None) -> None:
        if block is None:
            return
        carried = self._info["carried"].get(block) or [boundary_leaf(self._info, block)]
        if len(carried) != 1:
            raise PlanError(
                f"{self.arch}: block {block} passes {len(carried)} tensors to the next block (its output leaves "
                f"{carried}), and a pipeline boundary carries one activation.",
                "compile without pipeline stages for this model (one stage with dp/tp/ZeRO), or cut elsewhere.",
            )

    def _inject_input(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._received is None:
            return args, kwargs
        if args and isinstance(args[0], torch.Tensor):
            return (self._received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._received}

    def _capture_input(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        self._captured = _hidden_arg(args, kwargs)
        self._done = True
        raise _StageDone

    def _wrap_block(self, path: str) -> None:
        block = _submodule(self.__dict__["_root"], path)
        inner = block.forward
        stage = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            if stage.recompute == "none" or not torch.is_grad_enabled():
                out = inner(*args, **kwargs)
            else:
                kw: dict[str, Any] = {"use_reentrant": False}
                if stage.recompute == "selective":  # keep matmul outputs, recompute the rest
                    kw["context_fn"] = lambda: create_selective_checkpoint_contexts(_save_matmuls)
                out = checkpoint(inner, *args, **kw, **kwargs)
            if path == stage._end:
                stage._captured = pytree.tree_leaves(out)[boundary_leaf(stage._info, path)]
                stage._done = True
            return out

        block.forward = forward


def _answer_blocks(child: nn.Module, stage: GenericStage) -> None:
    """Make ``child()`` with no arguments return the stage's blocks (the model's own calls, with
    arguments, run its forward as before): the model has a child named ``blocks``, the name the
    program calls on the stage."""
    base = type(child)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            return stage.stage_blocks()
        return base.__call__(self, *args, **kwargs)

    child.__class__ = type(base.__name__, (base,), {"__call__": call})


def boundary_leaf(info: Mapping[str, Any], block: str) -> int:
    """Index of the output leaf of ``block`` that crosses a stage boundary: the one the next block
    reads (probed by identity), else the first tensor."""
    carried = info["carried"].get(block)
    if carried:
        return int(carried[0])
    return next(i for i, m in enumerate(info["leaves"][block]) if m is not None)


def split(model: nn.Module, layers: Sequence[str], all_layers: Sequence[str], device: torch.device) -> GenericStage:
    """Stage ``layers`` of ``model`` (see the module docstring)."""
    return GenericStage(model, layers, all_layers, device)


def boundary_shapes(
    model: nn.Module, stage_layers: Sequence[Sequence[str]], x: torch.Tensor
) -> list[tuple[torch.Size, torch.dtype]]:
    """Per-sample shape and dtype of each stage's output (one probe forward of the full model)."""
    all_layers = [n for layers in stage_layers for n in layers]
    info = probe(model, all_layers, x)
    out = []
    for layers in stage_layers[:-1]:
        blocks = _blocks(layers)
        if not blocks:
            shape, dtype = info["first_input"]
        else:
            shape, dtype = info["leaves"][blocks[-1]][boundary_leaf(info, blocks[-1])]
        out.append((torch.Size(shape), dtype))
    out.append((torch.Size(info["output"][0]), info["output"][1]))
    return out


def run_all(model: nn.Module, layers: Sequence[str], x: torch.Tensor) -> torch.Tensor:
    """The model's output for input ``x`` (all plan layers in order is the model's own forward)."""
    return _logits(_call(model, {**_example(model, x)}))
