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
  full model's): one of an earlier stage returns its probed output structure with the tensors this
  stage received in their places (zeros of the probed shape for the rest); one of a later stage that
  runs before this stage ends computes shapes on the meta device and returns zeros;
* the stage ends after its last unit: the first ghost called after it stops the forward
  (:class:`_StageDone`) and the stage returns what crosses its cut.

What crosses a cut (``boundary.py``, the rule ``passes/boundaries.py`` applies to the traced graph,
so the search prices what is sent): the activation the next block reads (after ``embed``: block 0's
input), plus every output of a unit before the cut that a unit after it reads and that depends on a
parameter. The probe (:func:`probe`, :data:`PROBE_BATCH` samples, every parameter requiring grad)
records which unit returned and which read each tensor. A T5 decoder cut carries the decoder state,
the encoder output and the relative position bias ``(1, heads, S, S)``: several tensors travel packed
into one (``boundary.pack``), so the pipeline runners still move one tensor per boundary. Later
stages read the model's raw inputs only for shapes: they get zeros of the probed shape, and a later
stage whose unit reads a raw input itself is refused with a :class:`~partita.errors.PlanError` (the
graph-side check, ``passes/boundaries.pipeline_refusal``, also catches a mask computed from an input
outside any module). Extra model inputs (``decoder_input_ids``) reach the first stage in the batch
tensor (the inputs stacked on dim 1, ``models/hf.py``'s ``pack``, which the model's own pre-hook
unpacks), or through :meth:`GenericStage.feed`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from partita.backends.torch import boundary
from partita.errors import PlanError
from partita.frontends import torch_shim

pytree = torch_shim.pytree()

GROUPS = ("embed", "head")
PROBE_BATCH = 3  # samples in the probe forward: dim 0 of 3 is the batch, 1 a shared tensor
_PROBE, _INPUTS, _HOOKS = "_partita_probe", "_partita_inputs", "_partita_capture_hooks"


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


def _example(model: nn.Module, x: torch.Tensor | None, probe: bool = False) -> dict[str, Any]:
    """The model's inputs for ``x`` (the first input; the others made by the model handle). ``probe``:
    :data:`PROBE_BATCH` samples (``x``'s first one repeated), so a probed tensor's dim 0 tells a
    per-sample tensor (the batch) from a shared one (1)."""
    if probe and x is not None:
        x = x[:1].expand(PROBE_BATCH, *x.shape[1:]).contiguous()
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
    batch = int(x.shape[0]) if x is not None else PROBE_BATCH
    inputs = {k: v for k, v in fn(batch, seq, device).items() if k != "labels"}
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
    """One forward (:data:`PROBE_BATCH` samples, every parameter requiring grad, on whatever device
    the model is: meta costs nothing) recording the order modules are called in and the data flow
    between them.

    Returns (and caches on ``model``) ``{"units": {plan layer: [unit paths]}, "treespec"/"leaves":
    {block: output structure / [(per-sample shape, dtype)]}, "first_input": (shape, dtype) of block
    0's input, "inputs": {name: (per-sample shape, dtype)}, "output": (shape, dtype)}`` and, per call
    ``k`` of each unit, ``"outs"``/``"specs"``/``"values"`` (full shapes, structure, non-tensor
    leaves) and, per output leaf ``(path, k, i)``, ``"grad"`` (depends on a parameter) and
    ``"reads"`` (the units that read it): what ``boundary.cut_layout`` needs.
    """
    cached = model.__dict__.get(_PROBE)
    if cached is not None and cached["layers"] == tuple(layers):
        return cached
    blocks = _blocks(layers)
    for b in blocks:
        _submodule(model, b)
    units = candidate_units(model, blocks)
    events: list[tuple[str, str]] = []
    info: dict[str, Any] = {
        "treespec": {},
        "leaves": {},
        "first_input": None,
        "carried": {},
        "arch": type(model).__name__,
    }
    info.update(outs={}, specs={}, values={}, grad={}, reads={}, raw_reads={}, first_input_key=None)
    last_out: dict[str, list[Any]] = {}
    made: dict[int, tuple[str, int, int]] = {}  # id(tensor) -> (unit, call, leaf) that returned it
    keep: list[Any] = []  # the probed tensors stay alive, so ids stay unique
    calls: dict[str, int] = {}
    raw: dict[int, str] = {}
    handles = []

    def pre(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            events.append(("pre", path))
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    if id(t) in made:
                        info["reads"][made[id(t)]].add(path)
                    if id(t) in raw:
                        info["raw_reads"].setdefault(raw[id(t)], set()).add(path)
            if path in blocks and blocks.index(path) > 0:  # which outputs of the block before it flow in
                given = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                prev = blocks[blocks.index(path) - 1]
                info["carried"][prev] = [i for i, t in enumerate(last_out.get(prev, [])) if id(t) in given]
            if path == (blocks[0] if blocks else None) and info["first_input"] is None:
                t = _hidden_arg(args, kwargs)
                info["first_input"] = (tuple(t.shape[1:]), t.dtype)
                info["first_input_full"] = (tuple(t.shape), t.dtype)
                info["first_input_key"] = made.get(id(t))

        return hook

    def post(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            events.append(("post", path))
            k = calls[path] = calls.get(path, -1) + 1
            leaves, spec = pytree.tree_flatten(out)
            info["specs"][(path, k)] = spec
            info["outs"][(path, k)] = [
                (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves
            ]
            for i, t in enumerate(leaves):
                if isinstance(t, torch.Tensor):
                    made[id(t)] = (path, k, i)
                    keep.append(t)
                    info["grad"][(path, k, i)] = t.requires_grad
                    info["reads"][(path, k, i)] = set()
                else:
                    info["values"][(path, k, i)] = t
            if path in blocks and path not in info["treespec"]:
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
    inputs = _example(model, x, probe=True)
    raw.update({id(v): k for k, v in inputs.items() if isinstance(v, torch.Tensor)})
    info["batch"] = int(next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape[0])
    # "needs a gradient" = depends on a parameter (the graph side's rule), frozen ones included
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        p.requires_grad_(True)
    try:
        with torch.enable_grad():
            out = _call(model, inputs)
    finally:
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(False)
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


def cut_after(info: Mapping[str, Any], all_layers: Sequence[str], c: int) -> list[boundary.Carried]:
    """The tensors crossing the cut after plan layer ``all_layers[c]`` (``boundary.cut_layout``): the
    activation the next block reads (a block's output leaf; after ``embed``, block 0's input), then
    every other unit output read after the cut that needs a gradient."""
    owner: dict[str, int] = {}
    for idx, name in enumerate(all_layers):
        for p in ([] if name in GROUPS else [name]) + list(info["units"].get(name, ())):
            owner[p] = idx
    before = {p for p, i in owner.items() if i <= c}
    after = {p for p, i in owner.items() if i > c}
    name = all_layers[c]
    if name in GROUPS:
        main = info["first_input_key"] or boundary.INPUT
    else:
        main = (name, 0, boundary_leaf(info, name))
    return boundary.cut_layout(info, before, after, main)


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
    """Stands in for a unit of another stage: no parameters. A unit of an earlier stage returns its
    probed output structure with the tensors this stage received in their places (zeros of the probed
    shape elsewhere); a later one called before this stage ends computes its output's shapes on the
    meta device and returns zeros; called after this stage's last unit, it ends the stage's forward."""

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
        if self.path in stage._before:
            got = stage._ghost_output(self.path)
            if got is not _NOT_PROBED:
                return got

        def to_meta(t: Any) -> Any:
            return t.detach().to("meta") if isinstance(t, torch.Tensor) else t

        out = self.__dict__["_shadow"](*pytree.tree_map(to_meta, args), **pytree.tree_map(to_meta, kwargs))
        return pytree.tree_map(
            lambda t: torch.zeros(t.shape, dtype=t.dtype, device=stage._device) if isinstance(t, torch.Tensor) else t,
            out,
        )


_NOT_PROBED = object()


class GenericStage(nn.Module):
    """One stage of any model: the model's children (FQNs unchanged), its own forward, units of
    other stages as :class:`Ghost`; ``forward(x)``: stage 0 takes the first model input, later stages
    the previous stage's boundary tensor; returns this stage's boundary tensor (the logits at the end).
    A boundary carries every tensor crossing the cut (``boundary.py``: one tensor as it is, several
    packed into one)."""

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
        self.__dict__["_own"] = tuple(own)  # the root's own parameters: share_own() hands ours to the forward
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
        self._before = {
            p for n in all_layers[: idx[0]] for p in ([] if n in GROUPS else [n]) + info["units"].get(n, [])
        }
        self._inject_into = blocks[0] if (not self.first and all_layers[idx[0] - 1] in GROUPS) else None
        where = f"{self.arch} stage of {layers[0]} .. {layers[-1]}"
        self._in = [] if self.first else cut_after(info, all_layers, idx[0] - 1)
        self._out = [] if self.last else cut_after(info, all_layers, idx[-1])
        self._where = where
        self._want = {c.key for c in self._out}
        self._recv: dict[tuple[str, int, int], torch.Tensor] = {}
        self._got: dict[tuple[str, int, int], torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._n = 0
        self._done = False
        self._feed: list[dict[str, Any]] = []
        self._fed = 0
        if not self.first:  # later stages get zeros for the model's inputs: none of their units may read one
            read = {name: sorted(set(us) & keep) for name, us in info["raw_reads"].items() if set(us) & keep}
            if read:
                raise PlanError(
                    f"{where} reads model input(s) {read} (input: modules), which only the first pipeline stage "
                    "receives.",
                    "compile without pipeline stages for this model (one stage with dp/tp/ZeRO), or cut so that "
                    "those modules sit in the first stage.",
                )
        tail = [n for n in all_layers[idx[-1] :] if n in mine]
        self._end = None if self.last else (_blocks(tail)[-1] if _blocks(tail) else "embed")
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
        for h in model.__dict__.pop(_HOOKS, []):  # a stage built again on this model: its hooks count calls once
            h.remove()
        hooks = model.__dict__[_HOOKS] = []
        for path in sorted({c.key[0] for c in self._out} & keep):  # what this stage sends on: kept at return
            hooks.append(_submodule(model, path).register_forward_hook(self._capture_output(path)))
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
        self._feed, self._fed = [dict(i) for i in inputs], 0

    def boundary_layout(self) -> tuple[list[boundary.Carried], list[boundary.Carried]]:
        """(what this stage receives, what it sends): the tensors crossing its cuts."""
        return list(self._in), list(self._out)

    def share_own(self) -> None:
        """The model's forward reads the root's own parameters as this module holds them now (FSDP2
        swaps its sharded / unsharded ones in here, the unit that owns them; issue 31)."""
        root = self.__dict__["_root"]
        for k in self.__dict__["_own"]:
            root._parameters[k] = self._parameters[k]

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._done, self._got, self._calls, self._n = False, {}, {}, int(x.shape[0])
        if self.first:
            inputs = {**self._extras(), "__first__": x}
        else:
            self._recv = boundary.unpack(x, self._in, self._where)
            n = x.shape[0]
            inputs = {k: torch.zeros((n, *s), dtype=d, device=x.device) for k, (s, d) in self._info["inputs"].items()}
            inputs["__first__"] = inputs.pop(next(iter(self._info["inputs"])))
        root = self.__dict__["_root"]
        self.share_own()
        first = inputs.pop("__first__")
        try:
            out = root(first, **inputs)
        except _StageDone:
            out = None
        finally:
            self._recv = {}
        if self._end is None:
            return _logits(out)
        missing = [c.name for c in self._out if c.key not in self._got]
        if missing:
            raise PlanError(
                f"{self._where}: the forward did not produce boundary tensor(s) {missing} the next stage reads.",
                "compile without pipeline stages for this model, or cut elsewhere.",
            )
        return boundary.pack([self._got[c.key] for c in self._out], self._out, self._where)

    def _extras(self) -> dict[str, Any]:
        if not self._feed:
            return {}
        got = self._feed[self._fed % len(self._feed)]
        self._fed += 1
        return got

    def _ghost_output(self, path: str) -> Any:
        """Unit ``path`` of an earlier stage: its probed output, received tensors in their places."""
        k = self._calls[path] = self._calls.get(path, -1) + 1
        metas = self._info["outs"].get((path, k))
        if metas is None:
            return _NOT_PROBED
        leaves = []
        for i, m in enumerate(metas):
            key = (path, k, i)
            if key in self._recv:
                t = self._recv[key]
            elif m is None:
                t = self._info["values"].get(key)
            else:
                shape = (self._n, *m[0][1:]) if m[0] and m[0][0] == self._info["batch"] else m[0]
                t = torch.zeros(shape, dtype=m[1], device=self._device)
            if key in self._want:  # passed on to the next stage
                self._got[key] = t
            leaves.append(t)
        return pytree.tree_unflatten(leaves, self._info["specs"][(path, k)])

    def _capture_output(self, path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            k = self._calls[path] = self._calls.get(path, -1) + 1
            for i, t in enumerate(pytree.tree_leaves(out)):
                if (path, k, i) in self._want:
                    self._got[(path, k, i)] = t

        return hook

    def _inject_input(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        got = self._recv.get(boundary.INPUT)
        if got is None:
            return args, kwargs
        if args and isinstance(args[0], torch.Tensor):
            return (got, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": got}

    def _capture_input(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if boundary.INPUT in self._want:
            self._got[boundary.INPUT] = _hidden_arg(args, kwargs)
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
    """Per-sample shape and dtype of the tensor each stage sends (``boundary.wire_shape``: several
    tensors crossing a cut travel packed), the last stage's output at the end (one probe forward)."""
    all_layers = [n for layers in stage_layers for n in layers]
    info = probe(model, all_layers, x)
    out, c = [], -1
    for layers in stage_layers[:-1]:
        c += len(layers)
        out.append(boundary.wire_shape(cut_after(info, all_layers, c)))
    out.append((torch.Size(info["output"][0]), info["output"][1]))
    return out


def cut_elems(model: nn.Module, stage_layers: Sequence[Sequence[str]], x: torch.Tensor) -> list[list[tuple[str, int]]]:
    """Per cut: (tensor, elements per sample) of what crosses it (what ``search/program/records.py`` prices)."""
    all_layers = [n for layers in stage_layers for n in layers]
    info = probe(model, all_layers, x)
    out, c = [], -1
    for layers in stage_layers[:-1]:
        c += len(layers)
        out.append([(k.name, k.elems) for k in cut_after(info, all_layers, c)])
    return out


def run_all(model: nn.Module, layers: Sequence[str], x: torch.Tensor) -> torch.Tensor:
    """The model's output for input ``x`` (all plan layers in order is the model's own forward)."""
    return _logits(_call(model, {**_example(model, x)}))
