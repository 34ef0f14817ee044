"""Fidelity of generated JAX programs: the collectives XLA compiled vs. the ones the plan predicts.

Used by ``backends/jax/train.py`` (which compiles every stage function and reads its HLO), by
``backends/jax/rehearse.py`` and by ``backends/jax/emit.py`` (which writes the plan's records into the program). Both sides are folded to
``{"kind@axis": {"ops": n, "bytes": b}}`` per stage and training step:

* measured (:func:`count_collectives`, :func:`weighted_collectives`, :func:`measured_summary`): one
  entry per HLO collective op; ``bytes`` per device of the whole operand (all-reduce and
  all-to-all: the result; all-gather: the gathered result; reduce-scatter: result x group size),
  the same convention as the plan's ``Collective.bytes``. The mesh axis comes from the op's device
  groups. Stage-to-stage transfers (``jax.device_put`` between sub-meshes) are no HLO op: the
  program counts them and adds them as ``p2p@pp``.
* planned (:func:`planned`): the plan's records (``Stage.collectives``), which
  ``search/program/jax_records.py`` builds as the program issues them, one record per HLO op and tensor,
  folded the same way. Nothing here models the runtime a second time.
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
def planned(stage: Any) -> dict[str, Any]:
    """The stage's records (``Stage.collectives``, built by ``search/program/jax_records.py``) folded to
    ``{"kind@axis": {"ops", "bytes", "why"}}`` per step in HLO kind names: read, not re-derived."""
    out: dict[str, Any] = {}
    for c in stage.collectives:
        key = f"{PLAN_KINDS.get(c.kind, c.kind)}@{c.axis}"
        e = out.setdefault(key, {"ops": 0, "bytes": 0.0, "why": []})
        e["ops"] += int(c.count)
        e["bytes"] += float(c.bytes) * int(c.count)
        why = re.sub(r" \S+\.\S+(,|$)", r"\1", c.reason)  # per-tensor reasons fold to one line
        if why and why not in e["why"]:
            e["why"].append(why)
    return dict(sorted(out.items()))


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
