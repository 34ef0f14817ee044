"""Fidelity of generated JAX programs: the collectives XLA compiled vs. the ones the plan predicts.

Used by ``backends/jax/train.py`` (which compiles every stage function and reads its HLO) and by
``backends/jax/emit.py`` (which writes the prediction into the program). Both sides are folded to
``{"kind@axis": {"ops": n, "bytes": b}}`` per stage and training step:

* measured (:func:`count_collectives`, :func:`weighted_collectives`, :func:`measured_summary`): one
  entry per HLO collective op; ``bytes`` per device of the whole operand (all-reduce and
  all-to-all: the result; all-gather: the gathered result; reduce-scatter: result x group size),
  the same convention as the plan's ``Collective.bytes``. The mesh axis comes from the op's device
  groups. Stage-to-stage transfers (``jax.device_put`` between sub-meshes) are no HLO op: the
  program counts them and adds them as ``p2p@pp``.
* predicted (:func:`predict_stage`): the plan's ``Stage.collectives`` as the JAX program issues
  them. Tensor-parallel entries map one to one (``count`` ops of ``bytes``). The dp gradient sync
  is one all-reduce per step (XLA's all-reduce combiner merges the per-tensor reductions, as the
  plan's bucketing assumes) whose bytes follow the parameters' layouts; with ZeRO the program
  reduce-scatters and all-gathers *per tensor*, because every parameter has its own dp-sharded
  layout and XLA's CPU pipeline combines neither reduce-scatters nor all-gathers, so those
  predictions count one op per dp-sharded tensor. The ZeRO parameter all-gathers are priced by
  the plan's cost model (``search/stage_cost.py``) but not recorded in ``Stage.collectives``:
  they are added here, ZeRO-1/2 once per step after the update, ZeRO-3 once per micro-batch
  (JAX keeps the gathered copy for that micro-batch's backward; the cost model prices a second
  gather in the backward, which XLA would merge with the first).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

AXES = ("dp", "tp")
HLO_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
PLAN_KINDS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "p2p": "p2p",
}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8}
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?P<start>-start)?\((?P<rest>.*)$"
)
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


# ---- HLO side --------------------------------------------------------------------------------
def _iota(sizes: Sequence[int], dims: str | None, perm: str | None) -> np.ndarray:
    ids = np.arange(int(np.prod(sizes)))
    if dims:
        ids = ids.reshape([int(x) for x in dims.split(",")])
        if perm:
            ids = ids.transpose([int(x) for x in perm.split(",")])
    return ids.reshape(sizes)


def _replica_groups(rest: str) -> list[list[int]] | None:
    """Device groups of a collective, from any of XLA's printed forms."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", rest)
    if m:  # XLA's own view of the devices: mesh['axis_0'=1,'axis_1'=4] {'axis_1'}; groups vary the listed axes
        named = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(n) for _, n in named]
        ids = _iota(sizes, m.group(2), m.group(3))
        listed = [i for i, (name, _) in enumerate(named) if f"'{name}'" in m.group(4)]
        others = [i for i in range(len(sizes)) if i not in listed]
        size = int(np.prod([sizes[i] for i in listed])) if listed else 1
        return ids.transpose(others + listed).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:  # iota form: [groups, size]<=[dims]T(perm)
        dims = [int(x) for x in m.group(2).split(",")]
        return _iota(dims, m.group(2), m.group(3)).reshape([int(x) for x in m.group(1).split(",")]).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return None


def _axes_of(groups: list[list[int]] | None, mesh_shape: Sequence[int]) -> str:
    """The stage-mesh axes ("dp", "tp", "dp,tp") a collective's device groups span."""
    if not groups:
        return "?"
    dp, tp = mesh_shape
    varied = set()
    for g in groups:
        coords = [(i // tp, i % tp) for i in g if i < dp * tp]
        if len({c[0] for c in coords}) > 1:
            varied.add("dp")
        if len({c[1] for c in coords}) > 1:
            varied.add("tp")
    return ",".join(a for a in AXES if a in varied) or "none"


def _phase(op_name: str) -> str:
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "other"


def count_collectives(hlo_text: str, mesh_shape: Sequence[int] = (1, 1)) -> dict[str, Any]:
    """Collectives in compiled HLO text, one entry per HLO op (XLA may combine several tensors in one).

    Returns ``{kind: ops, "by_axis": {"kind@axis": ops}, "bytes": {"kind@axis": bytes},
    "operands": {kind: tensors}, "elements": {kind: result elements}, "by_phase":
    {"kind@forward|backward|other": tensors}}``; the phase comes from each tensor's JAX name stack
    (``transpose(jvp(...))`` is backward).
    """
    counts = dict.fromkeys(HLO_KINDS, 0)
    operands = dict.fromkeys(HLO_KINDS, 0)
    elements = dict.fromkeys(HLO_KINDS, 0)
    by_axis: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    by_phase: dict[str, int] = {}
    for raw in hlo_text.splitlines():
        m = _OP.search(_COMMENT.sub("", raw))
        if not m:
            continue
        kind, rest = m.group("kind"), m.group("rest")
        groups = _replica_groups(rest)
        counts[kind] += 1
        key = f"{kind}@{_axes_of(groups, mesh_shape)}"
        by_axis[key] = by_axis.get(key, 0) + 1
        shapes = _SHAPE.findall(m.group("shape"))
        if m.group("start") and kind in ("all-gather", "collective-permute", "reduce-scatter"):
            shapes = shapes[len(shapes) // 2 :]  # async (operand, result) tuple: count the result
        operands[kind] += len(shapes)
        sizes = [int(np.prod([int(x) for x in dims.split(",") if x])) for _, dims in shapes]
        elements[kind] += sum(sizes)
        scale = len(groups[0]) if kind == "reduce-scatter" and groups else 1
        nbytes[key] = nbytes.get(key, 0) + scale * sum(n * DTYPE_BYTES.get(t, 4) for n, (t, _) in zip(sizes, shapes))
        name = re.search(r'op_name="([^"]*)"', rest)
        names = name.group(1) if name else ""
        inner = re.fullmatch(r"[^/]*/\((.*)\)", names)
        parts = inner.group(1).split(":") if inner else [names] * len(shapes)
        for part in parts[: len(shapes)] or [names]:
            k = f"{kind}@{_phase(part)}"
            by_phase[k] = by_phase.get(k, 0) + 1
    return {
        **counts,
        "by_axis": by_axis,
        "bytes": nbytes,
        "operands": operands,
        "elements": elements,
        "by_phase": by_phase,
    }


def weighted_collectives(per_function: Mapping[str, Mapping[str, Any]], calls: Mapping[str, int]) -> dict[str, Any]:
    """Per-step totals of a stage whose jitted functions run ``calls[name]`` times per step."""
    out: dict[str, Any] = dict.fromkeys(HLO_KINDS, 0)
    nested: dict[str, dict[str, int]] = {"by_axis": {}, "bytes": {}, "operands": {}, "elements": {}, "by_phase": {}}
    for name, counts in per_function.items():
        n = calls.get(name, 0)
        for k in HLO_KINDS:
            out[k] += n * counts[k]
        for field, acc in nested.items():
            for k, v in counts[field].items():
                acc[k] = acc.get(k, 0) + n * v
    return {**out, **nested}


def measured_summary(counts: Mapping[str, Any], transfers: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``{"kind@axis": {"ops", "bytes"}}`` of a stage's (weighted) HLO counts plus its p2p sends."""
    out = {k: {"ops": int(n), "bytes": float(counts["bytes"].get(k, 0))} for k, n in counts["by_axis"].items()}
    if transfers and transfers.get("ops"):
        out["p2p@pp"] = {"ops": int(transfers["ops"]), "bytes": float(transfers["bytes"])}
    return dict(sorted(out.items()))


# ---- plan side -------------------------------------------------------------------------------
def _add(out: dict[str, Any], key: str, ops: int, nbytes: float, why: str) -> None:
    e = out.setdefault(key, {"ops": 0, "bytes": 0.0, "why": []})
    e["ops"] += int(ops)
    e["bytes"] += float(nbytes)
    if why and why not in e["why"]:
        e["why"].append(why)


def _local_bytes(shape: Sequence[int], itemsize: int, spec: Any, mesh_shape: Sequence[int], axis: str = "tp") -> int:
    """Bytes per device of a tensor laid out by ``spec``, counting only the shards over ``axis``."""
    size = dict(zip(AXES, mesh_shape))[axis]
    n = int(np.prod(shape)) * itemsize
    for e in spec:
        if e == axis or (isinstance(e, tuple) and axis in e):
            n //= size
    return n


def predict_stage(
    stage: Any,
    num_micro_batches: int,
    params: Mapping[str, tuple[Sequence[int], int, Any, Any]],
) -> dict[str, Any]:
    """The JAX program's collectives per step for one plan stage (module docstring for the rules).

    ``params``: fqn -> (shape, itemsize, parameter spec, ZeRO / optimizer-state spec) for the
    stage's parameters; the specs are the generated program's ``PARAM_SPECS`` entries.
    """
    out: dict[str, Any] = {}
    mesh = (stage.dp, stage.tp)
    z, m = stage.zero_stage, num_micro_batches
    # Per device and tensor: the bytes of its tp shard (ZeRO's dp sharding is what the collective undoes).
    grads = {f: _local_bytes(shape, item, spec, mesh) for f, (shape, item, spec, _) in params.items()}
    sharded = [f for f, (_, _, _, zspec) in params.items() if _uses(zspec, "dp")]
    for c in stage.collectives:
        kind = PLAN_KINDS.get(c.kind, c.kind)
        if c.axis == "dp" and c.phase == "optimizer":  # the gradient sync, laid out per tensor below
            if z == 0:
                _add(out, "all-reduce@dp", c.count, c.count * sum(grads.values()), "gradient sync (one combined op)")
                continue
            if sharded:
                rs_bytes = c.count * sum(grads[f] for f in sharded)
                _add(out, "reduce-scatter@dp", c.count * len(sharded), rs_bytes, "ZeRO gradient reduce-scatter")
            rest = [f for f in params if f not in sharded]
            if rest:
                ar_bytes = c.count * sum(grads[f] for f in rest)
                _add(out, "all-reduce@dp", c.count, ar_bytes, "gradients no dp layout divides")
            continue
        axis = "pp" if c.kind == "p2p" else c.axis
        _add(out, f"{kind}@{axis}", c.count, c.count * c.bytes, c.reason)
    if stage.dp > 1 and sharded and z in (1, 2):
        _add(out, "all-gather@dp", len(sharded), sum(grads[f] for f in sharded), f"ZeRO-{z} updated parameters")
    if stage.dp > 1 and sharded and z >= 3:
        ag_bytes = m * sum(grads[f] for f in sharded)
        _add(out, "all-gather@dp", m * len(sharded), ag_bytes, "ZeRO-3 parameters, once per micro-batch")
    return dict(sorted(out.items()))


def _uses(spec: Any, axis: str) -> bool:
    return any(e == axis or (isinstance(e, tuple) and axis in e) for e in spec)


def compare(measured: Mapping[str, Mapping[str, float]], predicted: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Human-readable mismatches per ``kind@axis`` in ops or bytes ([] when they agree)."""
    problems = []
    for key in sorted(set(measured) | set(predicted)):
        got, want = measured.get(key, {}), predicted.get(key, {})
        mo, po = int(got.get("ops", 0)), int(want.get("ops", 0))
        mb, pb = float(got.get("bytes", 0)), float(want.get("bytes", 0))
        if mo != po or abs(mb - pb) > 1e-6 * max(mb, pb, 1.0):
            problems.append(f"{key}: measured {mo} ops / {mb:.0f} B, predicted {po} ops / {pb:.0f} B")
    return problems
