"""Mechanism under the generated JAX programs: layouts, meshes, model and data, stage split, schedule.

Used by ``backends/jax/train.py`` (the training loops the generated ``program_jax.py`` runs) and by
``backends/jax/emit.py``; the decisions (meshes, per-parameter PartitionSpecs, stage split,
activation pins, schedule) are literal data in the generated file.

* :func:`partition_spec` turns a plan placement (one ``"R"`` / ``"S(d)"`` per mesh axis
  ``("dp", "tp")``) into a ``PartitionSpec`` (per tensor dim, the mesh axes that shard it);
  :func:`zero_spec` adds the ``dp`` axis for ZeRO-sharded parameters / optimizer states.
* :func:`stage_mesh` builds a stage's ``Mesh`` from its ranks (``AxisType.Auto`` axes, so
  ``with_sharding_constraint`` and propagation apply).
* :func:`split_model` cuts ``loss_fn(params, *batch)`` into pipeline stages: the loss is traced to a
  jaxpr on abstract micro-batch shapes, every equation gets a layer (from its flax name stack, or
  the latest layer among its inputs, so the split is always monotone), consecutive layers form
  segments, and each stage becomes a function of (its parameters, its boundary inputs). Segments
  are evaluated equation by equation, so values crossing layer boundaries and the outputs of named
  modules can be pinned to a layout.
* :func:`pipeline_schedule` merges the plan's per-rank action lists (``search/pipeline/schedule.py``, GPipe /
  1F1B / interleaved 1F1B over model chunks) into the order the program dispatches.

HLO collective counting and the plan's predictions live in ``backends/jax/fidelity.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from partita.errors import ModelError, PlanError
from partita.search.pipeline.schedule import pipeline_actions, splits_backward

AXES = ("dp", "tp")
_SHARD = re.compile(r"S\((-?\d+)\)")


# ---- layouts ---------------------------------------------------------------------------------
def partition_spec(placements: Sequence[str], shape: Sequence[int], mesh_shape: Sequence[int], what: str = "") -> P:
    """``("S(0)", "S(1)")`` over axes (dp, tp) -> ``P("dp", "tp")``; checks divisibility."""
    ndim = len(shape)
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for axis, p in zip(AXES, placements):
        if p == "R":
            continue
        m = _SHARD.fullmatch(p)
        if not m:
            raise PlanError(
                f"{what}: placement {p!r} on axis {axis!r} cannot lay out a stored tensor.",
                'use "R" or "S(d)" for parameters and boundary activations ("P" only for partial results).',
            )
        d = int(m.group(1)) + (ndim if int(m.group(1)) < 0 else 0)
        if not 0 <= d < ndim:
            raise PlanError(f"{what}: placement {p} names dim {d} of a rank-{ndim} tensor.", "recompile the plan.")
        dims[d].append(axis)
    sizes = dict(zip(AXES, mesh_shape))
    for d, axes in enumerate(dims):
        n = int(np.prod([sizes[a] for a in axes])) if axes else 1
        if shape[d] % n:
            raise PlanError(
                f"{what}: dim {d} of size {shape[d]} does not split over {'x'.join(axes)} ({n} devices).",
                "pick a mesh shape that divides the dimension.",
            )
    return P(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims])


def spec_axes(spec: P) -> list[tuple[str, ...]]:
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def zero_spec(spec: P, shape: Sequence[int], mesh_shape: Sequence[int], axis: str = "dp") -> P:
    """Add ``axis`` to the largest dim it divides (ZeRO over dp); unchanged if already used or none fits."""
    sizes = dict(zip(AXES, mesh_shape))
    entries = spec_axes(spec) + [()] * (len(shape) - len(spec))
    if sizes[axis] == 1 or any(axis in e for e in entries):
        return spec
    for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
        n = int(np.prod([sizes[a] for a in entries[d]])) * sizes[axis]
        if shape[d] % n == 0:
            entries[d] = (*entries[d], axis)
            return P(*[None if not e else e[0] if len(e) == 1 else e for e in entries])
    return spec


def fit_spec(spec: P, ndim: int) -> P:
    """Truncate an activation spec to a rank-``ndim`` value."""
    return P(*list(spec)[:ndim])


def module_pin(meshes: Sequence[Mesh], tps: Sequence[int]) -> Callable[[int, Sequence[P], Any], Any]:
    """The ``pin`` of :func:`split_model`: constrain a module output of stage ``s`` to each of its
    layouts (``activation_pins``) on that stage's mesh; nothing to pin where the stage has tp = 1."""

    def pin(s: int, specs: Sequence[P], x: Any) -> Any:
        if tps[s] == 1:
            return x
        for spec in specs:
            if len(spec) <= x.ndim:
                x = jax.lax.with_sharding_constraint(x, NamedSharding(meshes[s], spec))
        return x

    return pin


def stage_mesh(ranks: Sequence[int], dp: int, tp: int) -> Mesh:
    """The ``("dp", "tp")`` mesh of a stage: rank ``ranks[i * tp + j]`` at coordinate (i, j)."""
    devices = jax.devices()
    if max(ranks) >= len(devices):
        raise PlanError(
            f"the plan needs rank {max(ranks)} but JAX sees {len(devices)} devices.",
            "launch with JAX_NUM_CPU_DEVICES (or enough processes) to cover the plan's world size.",
        )
    grid = np.array([devices[r] for r in ranks], dtype=object).reshape(dp, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)


# ---- model and data --------------------------------------------------------------------------
def load_model(spec: str) -> Any:
    """A JAX model handle: the zoo's entry, or ``package.module:factory`` (called with no args)."""
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        obj = getattr(importlib.import_module(mod), attr)
        return obj() if callable(obj) and not hasattr(obj, "loss_fn") else obj
    from partita.models.jax_gpt import gpt_handle, mlp_handle

    local = {"jax-gpt-tiny": gpt_handle, "jax-mlp": mlp_handle}
    if spec in local:  # also before the zoo registers them
        return local[spec]()
    from partita.models import resolve_model  # type: ignore[attr-defined]

    handle = resolve_model(spec)
    if getattr(handle, "framework", "jax") != "jax":
        raise ModelError(f"model {spec!r} is a {handle.framework} model.", "use the torch emitter for it.")
    return handle


def flatten(tree: Any) -> dict[str, Any]:
    """``{"params": {"fc1": {"kernel": x}}}`` -> ``{"params.fc1.kernel": x}`` (pytree path order)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key(k) for k in path): leaf for path, leaf in flat}


def unflatten(like: Any, flat: Mapping[str, Any]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[".".join(_key(k) for k in p)] for p, _ in paths])


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def make_batch(handle: Any, batch: int, seq: int, seed: int) -> list[np.ndarray]:
    """Seeded host data matching ``handle.example_batch``: normal floats, ints in ``[0, vocab)``."""
    rng = np.random.default_rng(seed)
    vocab = int(getattr(getattr(handle, "config", None), "vocab", 2))
    out = []
    for s in handle.example_batch(batch, seq):
        if jnp.issubdtype(s.dtype, jnp.integer):
            out.append(rng.integers(0, vocab, s.shape).astype(s.dtype))
        else:
            out.append(rng.standard_normal(s.shape).astype(s.dtype))
    return out


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Place a host array (identical on every process) as a global array, multi-process safe."""
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(x: jax.Array) -> np.ndarray:
    """Gather a (possibly multi-process) global array to a numpy array."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ---- stage split -----------------------------------------------------------------------------
def _layer_of_path(path: str, layers: Sequence[str]) -> int | None:
    best, best_len = None, -1
    for i, name in enumerate(layers):
        if (path == name or path.startswith(name + ".")) and len(name) > best_len:
            best, best_len = i, len(name)
    return best


def _name_path(eqn: Any) -> str:
    parts = []
    for p in str(eqn.source_info.name_stack).split("/"):
        while m := re.fullmatch(r"[A-Za-z_][\w.]*\((.*)\)", p):  # jvp(GPT) -> GPT
            p = m.group(1)
        if p:
            parts.append(p)
    if parts and parts[0][:1].isupper():  # the flax root module's class name
        parts = parts[1:]
    return ".".join(parts)


def _param_path(fqn: str) -> str:
    return fqn.split(".", 1)[1] if fqn.startswith("params.") else fqn


@dataclasses.dataclass
class StageProgram:
    """One pipeline stage: ``apply(params, inputs) -> outputs`` over the values named below.

    ``inputs`` are, in order, the jaxpr values the stage reads from outside (batch leaves and
    earlier stages' outputs); ``outputs`` what later stages (or the loss) read from it.
    """

    index: int
    param_fqns: list[str]
    inputs: list[int]  # value ids
    outputs: list[int]
    apply: Callable[..., list[Any]]


@dataclasses.dataclass
class ModelSplit:
    stages: list[StageProgram]
    batch_ids: list[int]  # value id of each batch leaf
    avals: dict[int, Any]  # value id -> ShapedArray
    producer: dict[int, int]  # value id -> stage index producing it (-1: batch input)
    loss_id: int
    pinned: dict[str, int] = dataclasses.field(default_factory=dict)  # module -> outputs pinned

    def is_float(self, vid: int) -> bool:
        return bool(jnp.issubdtype(self.avals[vid].dtype, jnp.floating))


Constrain = Callable[[int, int, Any], Any]
ModulePin = Callable[[int, Sequence[Any], Any], Any]


def split_model(
    loss_fn: Callable[..., Any],
    abstract_params: Any,
    micro_batch: Sequence[Any],
    layers: Sequence[str],
    stage_layers: Sequence[Sequence[str]],
    constrain: Constrain | None = None,
    *,
    module_pins: Mapping[str, Sequence[Sequence[Any]]] | None = None,
    pin: ModulePin | None = None,
    remat_stages: Collection[int] = (),
) -> ModelSplit:
    """Cut ``loss_fn`` into ``len(stage_layers)`` stage programs over the plan's layer names.

    ``constrain(stage, value_id, x)`` is applied to every value crossing a layer boundary inside a
    stage (the generated program pins those activations with ``with_sharding_constraint``).
    ``module_pins[module][k]`` lists layouts for the ``k``-th output of flax module ``module`` (a
    value made inside it and read outside it, in program order); ``pin(stage, layouts, x)``
    applies them. Layer segments of the stages in ``remat_stages`` run under ``jax.checkpoint``
    (recomputed in the backward).
    """
    abstract_batch = [jax.ShapeDtypeStruct(np.shape(b), b.dtype) for b in micro_batch]
    closed = jax.make_jaxpr(loss_fn)(abstract_params, *abstract_batch)
    jaxpr = closed.jaxpr
    fqns = list(flatten(abstract_params))
    num_params = len(fqns)
    stage_of_layer = {name: s for s, names in enumerate(stage_layers) for name in names}
    ids: dict[Any, int] = {}

    def vid(v: Any) -> int:
        return ids.setdefault(v, len(ids))

    layer: dict[int, int | None] = {}  # value id -> layer index (None: not yet placed)
    param_of: dict[int, str] = {}
    for fqn, v in zip(fqns, jaxpr.invars[:num_params]):
        param_of[vid(v)] = fqn
        layer[vid(v)] = _layer_of_path(_param_path(fqn), layers)
    batch_ids = [vid(v) for v in jaxpr.invars[num_params:]]
    for i in batch_ids:
        layer[i] = None
    consts = {vid(v): c for v, c in zip(jaxpr.constvars, closed.consts)}
    for i in consts:
        layer[i] = None
    eqn_layer: list[int | None] = []
    for eqn in jaxpr.eqns:
        cands = [layer[vid(v)] for v in eqn.invars if not isinstance(v, jcore.Literal)]
        named = _layer_of_path(_name_path(eqn), layers)
        known = [c for c in [*cands, named] if c is not None]
        lay = max(known) if known else None
        eqn_layer.append(lay)
        for o in eqn.outvars:
            layer[vid(o)] = lay
    # Equations tied to no layer (constants, iotas) run where their first consumer runs.
    last = len(layers) - 1
    need: dict[int, int] = {vid(v): last for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    for k in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[k]
        if eqn_layer[k] is None:
            eqn_layer[k] = min([need.get(vid(o), last) for o in eqn.outvars])
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                need[vid(v)] = min(need.get(vid(v), last), eqn_layer[k])  # type: ignore[type-var]
    layer_stage = []
    for name in layers:
        if name not in stage_of_layer:
            raise PlanError(f"layer {name!r} is in no stage of the plan.", "stages must cover every layer.")
        layer_stage.append(stage_of_layer[name])
    if layer_stage != sorted(layer_stage):
        raise PlanError("the plan's stages do not take layers in model order.", "recompile the plan.")
    num_stages = len(stage_layers)
    # Group equations into per-layer segments, keep program order inside each.
    seg_eqns: list[list[Any]] = [[] for _ in layers]
    for eqn, lay in zip(jaxpr.eqns, eqn_layer):
        seg_eqns[int(lay)].append(eqn)  # type: ignore[arg-type]
    defined_in: dict[int, int] = {}
    for s_idx, eqns in enumerate(seg_eqns):
        for eqn in eqns:
            for o in eqn.outvars:
                defined_in[vid(o)] = s_idx
    uses: dict[int, set[int]] = {}
    for s_idx, eqns in enumerate(seg_eqns):
        for eqn in eqns:
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    uses.setdefault(vid(v), set()).add(s_idx)
    loss_var = jaxpr.outvars[0]
    loss_id = vid(loss_var)
    uses.setdefault(loss_id, set()).add(len(layers))  # the loss leaves the last layer
    param_stage: dict[str, int] = {}
    for pid, fqn in param_of.items():
        stages_using = {layer_stage[u] for u in uses.get(pid, set()) if u < len(layers)}
        if len(stages_using) > 1:
            raise PlanError(
                f"parameter {fqn} is used by stages {sorted(stages_using)} (tied weights).",
                "keep layers that share a parameter in one stage.",
            )
        param_stage[fqn] = stages_using.pop() if stages_using else 0
    pins = _module_outputs(jaxpr, vid, module_pins or {})
    producer = {i: (layer_stage[s] if s < len(layers) else -1) for i, s in defined_in.items()}
    for i in batch_ids:
        producer[i] = -1
    stages: list[StageProgram] = []
    for st in range(num_stages):
        segs = [k for k in range(len(layers)) if layer_stage[k] == st]
        p_fqns = [f for f in fqns if param_stage[f] == st]
        p_ids = {pid for pid, f in param_of.items() if param_stage[f] == st}
        inside = {i for i, k in defined_in.items() if k in segs}
        reads: list[int] = []
        for k in segs:
            for eqn in seg_eqns[k]:
                for v in eqn.invars:
                    if isinstance(v, jcore.Literal):
                        continue
                    i = vid(v)
                    if i not in inside and i not in p_ids and i not in consts and i not in reads:
                        reads.append(i)
        if st == num_stages - 1:
            if loss_id not in inside:
                raise PlanError("the loss is not computed by the last stage.", "recompile the plan.")
            outs = [loss_id]
        else:
            outs = [
                i for i in sorted(inside) if any(layer_stage[u] > st for u in uses.get(i, set()) if u < len(layers))
            ]
        seg_funcs = []
        for k in segs:
            seg_in = sorted(
                {vid(v) for e in seg_eqns[k] for v in e.invars if not isinstance(v, jcore.Literal)}
                - {vid(o) for e in seg_eqns[k] for o in e.outvars}
            )
            seg_out = sorted(
                i for i in {vid(o) for e in seg_eqns[k] for o in e.outvars} if any(u > k for u in uses.get(i, set()))
            )
            fn = _segment_fn(
                seg_eqns[k], vid, seg_in, seg_out, pins, (lambda s, x, st=st: pin(st, s, x)) if pin else None
            )
            seg_funcs.append((seg_in, seg_out, jax.checkpoint(fn) if st in remat_stages else fn))
        stages.append(
            StageProgram(
                st,
                p_fqns,
                reads,
                outs,
                _stage_apply(st, p_fqns, p_ids, param_of, reads, outs, seg_funcs, consts, constrain),
            )
        )
    for st in stages:
        if st.index < num_stages - 1 and not st.param_fqns and not st.outputs:
            raise PlanError(
                f"stage {st.index} ({list(stage_layers[st.index])}) got no part of the model.",
                "the plan's layer names must be the model's module names (e.g. blocks_0).",
            )
    avals = {i: v.aval for v, i in ids.items()}
    pinned: dict[str, int] = {}
    for m, _ in pins.values():
        pinned[m] = pinned.get(m, 0) + 1
    return ModelSplit(stages, batch_ids, avals, producer, loss_id, pinned)


def _module_outputs(
    jaxpr: Any, vid: Callable[[Any], int], module_pins: Mapping[str, Sequence[Sequence[Any]]]
) -> dict[int, tuple[str, Sequence[Any]]]:
    """value id -> (module, layouts) for the outputs of the pinned modules (made inside, read outside).

    A module whose output count differs from its pin list is left unpinned (the jaxpr and the
    plan's graph disagree about it: better no pin than a wrong one).
    """
    if not module_pins:
        return {}
    made_by: dict[int, str] = {}
    outs: dict[str, list[int]] = {m: [] for m in module_pins}
    for eqn in jaxpr.eqns:
        path = _name_path(eqn)
        for v in eqn.invars:
            if isinstance(v, jcore.Literal):
                continue
            m = made_by.get(vid(v))
            if m is not None and not (path == m or path.startswith(m + ".")) and vid(v) not in outs[m]:
                outs[m].append(vid(v))
        for o in eqn.outvars:
            if path in outs:
                made_by[vid(o)] = path
    for v in jaxpr.outvars:
        m = made_by.get(vid(v)) if not isinstance(v, jcore.Literal) else None
        if m is not None and vid(v) not in outs[m]:
            outs[m].append(vid(v))
    result: dict[int, tuple[str, Sequence[Any]]] = {}
    for m, vids in outs.items():
        if len(vids) == len(module_pins[m]):
            result.update({i: (m, module_pins[m][k]) for k, i in enumerate(sorted(vids))})
    return result


def _segment_fn(
    eqns: Sequence[Any],
    vid: Callable[[Any], int],
    seg_in: Sequence[int],
    seg_out: Sequence[int],
    pins: Mapping[int, tuple[str, Sequence[Any]]],
    pin: Callable[[Sequence[Any], Any], Any] | None,
) -> Callable[..., list[Any]]:
    """Evaluate one layer's equations (``jax.core.eval_jaxpr``'s loop) with module-output pins."""

    def fn(*args: Any) -> list[Any]:
        env = dict(zip(seg_in, args))
        for eqn in eqns:
            params = eqn.primitive.get_bind_params(eqn.params)
            sub, params = params if isinstance(params, tuple) else ((), params)  # jax < 0.7 also returned subfuns
            ins = [v.val if isinstance(v, jcore.Literal) else env[vid(v)] for v in eqn.invars]
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*sub, *ins, **params)
            for o, x in zip(eqn.outvars, ans if eqn.primitive.multiple_results else [ans]):
                i = vid(o)
                env[i] = pin(pins[i][1], x) if pin is not None and i in pins else x
        return [env[i] for i in seg_out]

    return fn


def _stage_apply(
    st: int,
    p_fqns: list[str],
    p_ids: set[int],
    param_of: Mapping[int, str],
    reads: list[int],
    outs: list[int],
    seg_funcs: list[tuple[list[int], list[int], Callable[..., Any]]],
    consts: Mapping[int, Any],
    constrain: Constrain | None,
) -> Callable[..., list[Any]]:
    def apply(params: Mapping[str, Any], inputs: Sequence[Any]) -> list[Any]:
        env: dict[int, Any] = dict(consts)
        env.update({pid: params[param_of[pid]] for pid in p_ids})
        env.update(zip(reads, inputs))
        for n, (seg_in, seg_out, fn) in enumerate(seg_funcs):
            vals = fn(*[env[i] for i in seg_in])
            for i, x in zip(seg_out, vals):
                env[i] = constrain(st, i, x) if constrain is not None and n < len(seg_funcs) - 1 else x
        return [env[i] for i in outs]

    return apply


# ---- schedule --------------------------------------------------------------------------------
def pipeline_schedule(
    schedule: str, num_stages: int, num_micro_batches: int, num_chunks: int = 1
) -> list[tuple[str, int, int]]:
    """Dispatch order ``(action, stage, micro_batch)`` of the plan's schedule.

    Each rank group's own order is its list in ``search/schedule.pipeline_actions`` (the list the
    cost model simulates): "F" the forward, "B" the whole backward (the last stage's "B" starts from
    the loss), "W" never (no JAX program splits the backward). With model chunks (``num_chunks``
    per rank group, interleaved 1F1B: a chunked plan's ``num_stages`` virtual stages on
    ``num_stages / num_chunks`` rank groups, loop placement) a list holds the actions of all the
    group's chunks. The global list interleaves the per-group lists respecting the data dependencies
    (F after the previous stage's F, B after the stage's own F and the next stage's B); JAX executes
    each device's work in dispatch order, so every rank group runs its list in the listed order.
    """
    if splits_backward(schedule):
        raise PlanError(
            f"schedule {schedule} splits the backward into input and weight gradients, which the JAX program "
            "cannot run.",
            "use gpipe, 1f1b or interleaved_1f1b for JAX plans.",
        )
    n, m = num_stages, num_micro_batches
    groups = n // num_chunks
    per_group = [
        [(a.kind, a.stage, a.micro) for a in acts] for acts in pipeline_actions(schedule, groups, m, num_chunks)
    ]
    done: set[tuple[str, int, int]] = set()
    pos = [0] * groups
    out: list[tuple[str, int, int]] = []
    while any(pos[r] < len(per_group[r]) for r in range(groups)):
        progressed = False
        for r in range(groups):
            if pos[r] >= len(per_group[r]):
                continue
            act, s, i = per_group[r][pos[r]]
            if act == "F":
                ready = s == 0 or ("F", s - 1, i) in done
            else:
                ready = ("F", s, i) in done and (s == n - 1 or ("B", s + 1, i) in done)
            if ready:
                done.add((act, s, i))
                out.append((act, s, i))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise PlanError(f"schedule {schedule!r} deadlocks for {n} stages.", "use gpipe or 1f1b.")
    return out
