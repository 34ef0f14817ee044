"""The Plan: the frozen, versioned record that is the single contract between search and codegen.

Written by ``search/`` (through ``driver.py``), read by the emitters and the runtime and by
``partita report``. Pure data, no framework imports. ``Plan.to_json()`` is deterministic (sorted
keys, floats rounded to 9 significant digits) so the same inputs give a byte-identical file.

Vocabulary (Megatron's, so hand-made configurations read the same):

* a stage runs a contiguous range of layers on ``dp * tp`` ranks arranged as a 2-D mesh with axes
  ``("dp", "tp")``; rank ``ranks[i * tp + j]`` sits at mesh coordinate ``(i, j)``;
* ``micro_batch_size`` is samples per micro-batch per data-parallel replica; a stage whose replicas
  run on different device types may split each micro-batch unevenly: ``batch_shares[i]`` samples
  for replica ``i`` (they sum to ``micro_batch_size * dp``), and gradients are averaged with those
  weights;
* ``global_batch = num_micro_batches * sum(batch_shares)`` for every stage;
* placements are per mesh axis, DTensor-style strings: ``"R"``, ``"S(d)"`` (shard tensor dim d),
  ``"SS(d,g)"`` (parameters only: dim d is g equal chunks, each sharded on its own, e.g. GPT-2's
  q|k|v weight split by heads; DTensor's ``_StridedShard(d, split_factor=g)``), ``"P"`` (partial
  sum).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.errors import PlanError

PLAN_FORMAT = "partita.plan"
PLAN_VERSION = 1
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")  # = search.schedule.SCHEDULE_FAMILIES
RECOMPUTE = ("none", "selective", "full")


def _round(x: Any) -> Any:
    if isinstance(x, float):
        if x == 0.0 or not math.isfinite(x):
            return x
        return float(f"{x:.9g}")
    if isinstance(x, Mapping):
        return {str(k): _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the stage issues per training step (``count`` times, ``bytes`` each)."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    axis: str  # mesh axis name ("dp", "tp") or "pp" for stage-to-stage transfers
    bytes: float
    count: int
    phase: str = "forward"  # forward | backward | optimizer
    reason: str = ""  # e.g. "row-parallel linear mlp.c_proj" or "gradient sync"


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    layers: tuple[str, ...]
    device_type: str  # the stage's device type, or "mixed" (see replica_device_types)
    ranks: tuple[int, ...]
    dp: int
    tp: int
    zero_stage: int = 0  # 0..3, over the dp axis
    recompute: str = "none"
    batch_shares: tuple[int, ...] = ()  # per dp replica, samples per micro-batch
    replica_device_types: tuple[str, ...] = ()  # per dp replica
    param_placements: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # fqn -> per axis
    input_placement: tuple[str, ...] = ("S(0)", "R")  # boundary activation entering the stage
    output_placement: tuple[str, ...] = ("S(0)", "R")
    op_strategies: Mapping[str, str] = dataclasses.field(default_factory=dict)  # node -> strategy name
    tp_plan: Mapping[str, str] = dataclasses.field(default_factory=dict)  # module -> torch tp role (search/strategies)
    collectives: tuple[Collective, ...] = ()
    predicted: Mapping[str, float] = dataclasses.field(default_factory=dict)  # compute_s, comm_s, memory...

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.dp, self.tp)

    def coords(self, rank: int) -> tuple[int, int]:
        i = self.ranks.index(rank)
        return (i // self.tp, i % self.tp)


@dataclasses.dataclass(frozen=True)
class Plan:
    model: Mapping[str, Any]  # name, framework, graph_hash, num_params, layers (ordered names)
    cluster: Mapping[str, Any]  # name, fingerprint, spec (Cluster.to_dict())
    training: Mapping[str, Any]  # global_batch, seq_len, dtype, optimizer
    stages: tuple[Stage, ...]
    schedule: str
    micro_batch_size: int
    num_micro_batches: int
    num_virtual_stages: int = 1  # interleaved 1F1B: model chunks per rank
    predicted: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # step_time_s, compute_s, ...
    search: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # time_s, candidates, ilp, alternatives
    partita_version: str = ""
    version: int = PLAN_VERSION

    @property
    def world_size(self) -> int:
        return sum(s.num_devices for s in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of_rank(self, rank: int) -> Stage:
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise PlanError(
            f"rank {rank} is not in any stage of this plan (world size {self.world_size}).",
            f"launch exactly {self.world_size} ranks.",
        )

    # ---- (de)serialization ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["format"] = PLAN_FORMAT
        return _round(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    @staticmethod
    def from_json(text: str, source: str = "plan.json") -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{source} is not valid JSON ({e.msg} at line {e.lineno}); it may be truncated.",
                "recompile with `partita compile ... --out DIR`.",
            ) from None
        return Plan.from_dict(d, source)

    @staticmethod
    def from_dict(d: Any, source: str = "plan.json") -> Plan:
        if not isinstance(d, Mapping) or d.get("format") != PLAN_FORMAT:
            raise PlanError(
                f"{source} is not a Partita plan (no format={PLAN_FORMAT!r}).",
                "pass the plan.json written by `partita compile`.",
            )
        if d.get("version") != PLAN_VERSION:
            raise PlanError(
                f"{source} has plan version {d.get('version')!r}; this Partita reads version {PLAN_VERSION}.",
                "recompile the plan with this Partita version.",
            )
        try:
            stages = tuple(
                Stage(
                    index=int(s["index"]),
                    layers=tuple(s["layers"]),
                    device_type=str(s["device_type"]),
                    ranks=tuple(int(r) for r in s["ranks"]),
                    dp=int(s["dp"]),
                    tp=int(s["tp"]),
                    zero_stage=int(s.get("zero_stage", 0)),
                    recompute=str(s.get("recompute", "none")),
                    batch_shares=tuple(int(x) for x in s.get("batch_shares", ())),
                    replica_device_types=tuple(s.get("replica_device_types", ())),
                    param_placements={k: tuple(v) for k, v in s.get("param_placements", {}).items()},
                    input_placement=tuple(s.get("input_placement", ("S(0)", "R"))),
                    output_placement=tuple(s.get("output_placement", ("S(0)", "R"))),
                    op_strategies=dict(s.get("op_strategies", {})),
                    tp_plan=dict(s.get("tp_plan", {})),
                    collectives=tuple(Collective(**c) for c in s.get("collectives", ())),
                    predicted=dict(s.get("predicted", {})),
                )
                for s in d["stages"]
            )
            plan = Plan(
                model=dict(d["model"]),
                cluster=dict(d["cluster"]),
                training=dict(d["training"]),
                stages=stages,
                schedule=str(d["schedule"]),
                micro_batch_size=int(d["micro_batch_size"]),
                num_micro_batches=int(d["num_micro_batches"]),
                num_virtual_stages=int(d.get("num_virtual_stages", 1)),
                predicted=dict(d.get("predicted", {})),
                search=dict(d.get("search", {})),
                partita_version=str(d.get("partita_version", "")),
                version=int(d["version"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(
                f"{source} is missing or has a malformed field ({type(e).__name__}: {e}).",
                "recompile the plan; do not edit plan.json by hand.",
            ) from None
        validate(plan, source)
        return plan


def read_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; unreadable, binary or truncated files raise PlanError naming it."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = "is not UTF-8 text (corrupt?)" if isinstance(e, UnicodeDecodeError) else f"cannot be read ({e.strerror})"
        raise PlanError(f"{path} {why}.", "recompile with `partita compile ... --out DIR`.") from None
    return Plan.from_json(text, str(path))


def validate(plan: Plan, source: str = "plan") -> None:
    """Structural checks every consumer relies on; raise PlanError naming the field."""
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"{source}: schedule {plan.schedule!r} is unknown.", f"use one of {SCHEDULES}.")
    if plan.micro_batch_size < 1 or plan.num_micro_batches < 1:
        raise PlanError(f"{source}: micro_batch_size and num_micro_batches must be >= 1.", "recompile the plan.")
    batch = plan.training.get("global_batch")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"{source}: training.global_batch is {batch!r}, not a positive integer.", "recompile the plan.")
    seen: set[int] = set()
    layers: list[str] = []
    for s in plan.stages:
        where = f"{source}: stage {s.index}"
        if s.dp < 1 or s.tp < 1 or len(s.ranks) != s.dp * s.tp:
            raise PlanError(f"{where} has dp={s.dp}, tp={s.tp} but {len(s.ranks)} ranks.", "need dp*tp ranks.")
        if len(set(s.ranks)) != len(s.ranks):
            dup = sorted({r for r in s.ranks if s.ranks.count(r) > 1})
            raise PlanError(f"{where} lists ranks {dup} more than once.", "each rank is in one stage, once.")
        if seen & set(s.ranks):
            raise PlanError(f"{where} reuses ranks {sorted(seen & set(s.ranks))}.", "each rank is in one stage.")
        seen |= set(s.ranks)
        if s.zero_stage not in (0, 1, 2, 3) or s.recompute not in RECOMPUTE:
            raise PlanError(
                f"{where}: zero_stage={s.zero_stage} recompute={s.recompute!r} out of range.",
                f"zero_stage in 0..3, recompute in {RECOMPUTE}.",
            )
        if s.batch_shares and (len(s.batch_shares) != s.dp or sum(s.batch_shares) != plan.micro_batch_size * s.dp):
            raise PlanError(
                f"{where}: batch_shares {list(s.batch_shares)} must have dp={s.dp} entries summing to "
                f"{plan.micro_batch_size * s.dp}.",
                "recompile the plan.",
            )
        samples = plan.num_micro_batches * sum(shares(s, plan.micro_batch_size))
        if samples != batch:
            raise PlanError(
                f"{where} trains {plan.num_micro_batches} micro-batches x {sum(shares(s, plan.micro_batch_size))} "
                f"samples = {samples} per step, but training.global_batch is {batch}.",
                "recompile the plan: the global batch must split exactly into micro-batches and replicas.",
            )
        layers.extend(s.layers)
    if seen != set(range(len(seen))):
        raise PlanError(f"{source}: ranks {sorted(seen)} are not 0..{len(seen) - 1}.", "recompile the plan.")
    expected = list(plan.model.get("layers", layers))
    if layers != expected:
        raise PlanError(
            f"{source}: stages cover layers {layers}, the model has {expected}.",
            "stages must cover every layer once, in order.",
        )


def shares(stage: Stage, micro_batch_size: int) -> tuple[int, ...]:
    """Per-replica samples per micro-batch (even split when the plan gives none)."""
    return stage.batch_shares or (micro_batch_size,) * stage.dp


def placements_to_str(p: Sequence[str]) -> str:
    return "(" + ", ".join(p) + ")"
