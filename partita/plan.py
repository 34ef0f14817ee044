"""The Plan: the frozen, versioned record that is the single contract between search and codegen.

Written by ``search/`` (through ``driver.py``), read by the emitters and the runtime and by
``partita report``. Pure data, no framework imports. ``Plan.to_json()`` is deterministic (sorted
keys, floats rounded to 9 significant digits) so the same inputs give a byte-identical file.

Vocabulary (Megatron's, so hand-made configurations read the same):

* a stage runs a contiguous range of layers on ``dp * tp`` ranks arranged as a 2-D mesh with axes
  ``("dp", "tp")``; rank ``ranks[i * tp + j]`` sits at mesh coordinate ``(i, j)``;
* context parallelism (issue 36): a stage with ``cp > 1`` runs on ``dp * cp * tp`` ranks, mesh axes
  ``("dp", "cp", "tp")``, tp fastest: rank ``ranks[(i * cp + c) * tp + j]`` at ``(i, c, j)`` holds
  tokens ``c * S / cp`` to ``(c + 1) * S / cp - 1`` of its replica's samples (``search/pricing/context_parallel.py``);
  parameters are replicated over cp as over dp. ``cp = 1`` (the default) is not written to plan.json,
  so plans without it read and write as before; no emitter runs ``cp > 1`` yet (they refuse it);
* precision per stage (issue 36): ``Stage.fp8`` names the torchao recipe (``training.fp8``'s) when the
  stage's linears train in FP8, and the program converts exactly those stages; a stage without it
  trains in ``training.dtype`` (a mixed cluster's types without FP8 tensor cores). Not written when
  unset; a plan from before per-stage precision (``training.fp8`` and no stage saying ``fp8``) reads
  with every stage in fp8, as its program ran;
* gradient buckets (issue 32 item 1): ``Stage.grad_buckets`` lists a ZeRO-0 stage's (dp > 1) gradient
  buckets, each a tuple of parameter names in the order the backward finishes them (the model's last
  layers first), each at most :data:`GRAD_BUCKET_BYTES` of f32 gradient (DDP's ``bucket_cap_mb=25``) or one
  larger parameter alone (synced in place, without a copy). The
  torch program all-reduces each bucket as soon as the stage's last backward has made all of its
  gradients (``backends/torch/parallel.GradBuckets``). Empty (the default, not written to plan.json): one
  flat all-reduce of all the stage's gradients after the schedule, as every plan before this field. Model
  chunks under interleaved 1F1B: each chunk (virtual stage) lists its own buckets, issued inside that
  chunk's last backward; under ZB-V the sync stays flat (:func:`flat_sync_chunks`);
* ``micro_batch_size`` is samples per micro-batch per data-parallel replica; a stage whose replicas
  run on different device types may split each micro-batch unevenly: ``batch_shares[i]`` samples
  for replica ``i`` (they sum to ``micro_batch_size * dp``), and gradients are averaged with those
  weights;
* ``global_batch = num_micro_batches * sum(batch_shares)`` for every stage;
* model chunks (virtual stages, issue 19): under ``interleaved_1f1b`` with ``num_virtual_stages = v >
  1`` and under ``zbv`` (``v = 2``) a rank group holds several model chunks. Such a plan lists one
  ``Stage`` per virtual stage, in model order, and the chunks of one rank group repeat its ranks and
  mesh: chunk ``c`` of pipeline position ``r`` is virtual stage ``c * p + r`` (loop placement,
  interleaved) or stages ``r`` and ``2p - 1 - r`` (V placement, zbv), ``p`` positions
  (:func:`chunk_position`). :meth:`Plan.stages_of_rank` gives a rank's chunks, :meth:`Plan.positions`
  the chunks per position. A plan whose stages share no ranks is a plain pipeline (a plan priced with
  ``num_virtual_stages > 1`` but one range per rank group keeps that meaning: chunks not laid out);
* placements are per mesh axis, DTensor-style strings: ``"R"``, ``"S(d)"`` (shard tensor dim d),
  ``"SS(d,g)"`` (parameters only: dim d is g equal chunks, each sharded on its own, e.g. GPT-2's
  q|k|v weight split by heads; DTensor's ``_StridedShard(d, split_factor=g)``), ``"P"`` (partial
  sum).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.errors import PlanError

PLAN_FORMAT = "partita.plan"
PLAN_VERSION = 1
GRAD_BUCKET_BYTES = 25 * 2**20  # Stage.grad_buckets: f32 bytes per bucket at most (DDP bucket_cap_mb), or one parameter
GRAD_BUCKETS_IN_FLIGHT = 2  # bucket copies the program holds at once (parallel.GradBuckets)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")  # = search.schedule.SCHEDULE_FAMILIES
RECOMPUTE = ("none", "selective", "full")


def chunks_per_rank(schedule: str, num_virtual_stages: int) -> int:
    """Model chunks a rank group holds under ``schedule`` (``search.schedule.virtual_stages`` calls this)."""
    if schedule == "zbv":
        return 2
    return num_virtual_stages if schedule == "interleaved_1f1b" else 1


def flat_sync_chunks(schedule: str, num_virtual_stages: int) -> bool:
    """Does the torch program keep a chunked plan's ZeRO-0 sync flat (one all-reduce after the schedule)?
    Only under ZB-V: its chunks' gradients are made in the deferred W actions, whose share of the backward
    the stage prices do not hold (the overlap window of a bucket issued from a W), so no bucket is planned
    there. Interleaved 1F1B's chunks sync in buckets from each chunk's last backward (``Stage.grad_buckets``)."""
    return schedule == "zbv" and chunks_per_rank(schedule, num_virtual_stages) > 1


def chunk_position(schedule: str, stage: int, num_positions: int) -> int:
    """Pipeline position (rank group, 0 .. p - 1) of virtual stage ``stage``: V placement under zbv
    (stages ``r`` and ``2p - 1 - r`` on position ``r``), loop placement otherwise (``stage % p``)."""
    p = num_positions
    if schedule == "zbv":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


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


def shards_on_tp(
    param_placements: Mapping[str, Sequence[str]], tp_plan: Mapping[str, str], op_strategies: Mapping[str, str]
) -> bool:
    """Does a stage (or one layer's solution) place anything on the ``tp`` mesh axis: a parameter not
    replicated on it, a module with a tp role, or an op whose strategy uses it (``"h@tp"``, JAX's
    activations)? The search offers no tp degree at which a stage shards nothing
    (``search/entry/planner.Search.options_for``); a hand layout that does is stated
    (:attr:`Stage.tp_shards_nothing`)."""
    if tp_plan or any(len(p) > 1 and p[1] != "R" for p in param_placements.values()):
        return True
    return any("@tp" in name for name in op_strategies.values())


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
    cp: int = 1  # context parallelism: the sequence split over a mesh axis between dp and tp (module docstring)
    fp8: str | None = None  # this stage's linears train in FP8 with this torchao recipe (module docstring)
    # ZeRO-0, dp > 1: the gradient buckets all-reduced inside the last backward (module docstring); () = one flat
    # all-reduce after the schedule
    grad_buckets: tuple[tuple[str, ...], ...] = ()
    # tp > 1 and nothing placed on tp (:func:`shards_on_tp`): every tp rank holds and computes the whole stage on
    # the same batch. Derived from the fields above when the stage is made, written to plan.json, checked when
    # read, stated by the report and by the program (issue 31: gpt-oss at tp=2 replicated every weight, unsaid).
    tp_shards_nothing: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        nothing = self.tp > 1 and not shards_on_tp(self.param_placements, self.tp_plan, self.op_strategies)
        object.__setattr__(self, "tp_shards_nothing", nothing)  # frozen: set once, here

    @property
    def num_devices(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.dp, self.tp)

    def coords(self, rank: int) -> tuple[int, int]:
        """``rank``'s (dp, tp) coordinates; its cp coordinate is :meth:`cp_index`."""
        i = self.ranks.index(rank)
        return (i // (self.cp * self.tp), i % self.tp)

    def cp_index(self, rank: int) -> int:
        """``rank``'s coordinate on the cp axis: which ``1 / cp`` of the sequence it holds (0 when cp = 1)."""
        return (self.ranks.index(rank) // self.tp) % self.cp


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

    @functools.cached_property  # a frozen dataclass: computed once (records and chunked ask per stage)
    def world_size(self) -> int:
        return len({r for s in self.stages for r in s.ranks})  # chunks of one rank group share ranks

    @property
    def num_stages(self) -> int:
        """Stages listed: virtual stages in a chunked plan (:attr:`chunked`)."""
        return len(self.stages)

    @functools.cached_property  # a frozen dataclass: computed once (records.py asks per stage)
    def chunked(self) -> bool:
        """True when rank groups hold several model chunks (stages share ranks; module docstring)."""
        return sum(len(s.ranks) for s in self.stages) != self.world_size

    @property
    def num_positions(self) -> int:
        """Pipeline positions (rank groups): ``num_stages`` unless the plan is chunked."""
        return (
            len(self.stages) // chunks_per_rank(self.schedule, self.num_virtual_stages)
            if self.chunked
            else len(self.stages)
        )

    def positions(self) -> tuple[tuple[Stage, ...], ...]:
        """Per pipeline position, its stages (chunks) in model order; one each in a plain pipeline."""
        if not self.chunked:
            return tuple((s,) for s in self.stages)
        p = self.num_positions
        return tuple(tuple(s for s in self.stages if chunk_position(self.schedule, s.index, p) == r) for r in range(p))

    def stages_of_rank(self, rank: int) -> tuple[Stage, ...]:
        """The stages (model chunks, in model order) ``rank`` runs: one unless the plan is chunked."""
        out = tuple(s for s in self.stages if rank in s.ranks)
        if not out:
            self.stage_of_rank(rank)  # raises the error below
        return out

    def stage_of_rank(self, rank: int) -> Stage:
        """The stage ``rank`` runs; in a chunked plan its first chunk (:meth:`stages_of_rank` gives all)."""
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
        for s in d["stages"]:  # a large stage's ranks as runs (issue 20); Stage.ranks stays a tuple
            if s["cp"] == 1:  # no context parallelism: not written (plans without it stay byte-identical)
                del s["cp"]
            if s["fp8"] is None:  # bf16 stage: not written (plans without fp8 stay byte-identical)
                del s["fp8"]
            if not s["grad_buckets"]:  # flat gradient sync: not written (older plans stay byte-identical)
                del s["grad_buckets"]
            if len(s["ranks"]) > RANK_RUNS_ABOVE:
                s["ranks"] = rank_runs(s["ranks"])
        used = d["cluster"].get("rank_map")  # plan rank -> cluster rank, as runs when large
        if isinstance(used, (list, tuple)) and len(used) > RANK_RUNS_ABOVE:
            d["cluster"] = {**d["cluster"], "rank_map": rank_runs(used)}
        return _round(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    @staticmethod
    def from_json(text: str, source: str = "plan.json") -> Plan:
        try:
            d = json.loads(text, parse_constant=_no_constant)
        except _NonFinite as e:
            raise PlanError(
                f"{source} holds {e.args[0]}, which no plan writes (not a number).",
                "recompile with `partita compile ... --out DIR`; do not edit plan.json by hand.",
            ) from None
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
        _unknown_keys(d, {f.name for f in dataclasses.fields(Plan)} | {"format"}, source, "")
        stages_in = d.get("stages")
        for k, st in enumerate(stages_in if isinstance(stages_in, list) else []):  # a non-list is named below
            if isinstance(st, Mapping):
                _unknown_keys(st, {f.name for f in dataclasses.fields(Stage)}, source, f"stages[{k}].")
        field = _FieldReader()
        try:
            stages = tuple(_read_stage(field, s, k) for k, s in enumerate(field(d, "stages", list)))
            stages = _legacy_fp8(field(d, "training", dict), stages_in, stages)
            plan = Plan(
                model=field(d, "model", dict),
                cluster=_cluster_from_json(field(d, "cluster", dict)),
                training=field(d, "training", dict),
                stages=stages,
                schedule=field(d, "schedule", str),
                micro_batch_size=field(d, "micro_batch_size", int),
                num_micro_batches=field(d, "num_micro_batches", int),
                num_virtual_stages=field(d, "num_virtual_stages", int, 1),
                predicted=field(d, "predicted", dict, {}),
                search=field(d, "search", dict, {}),
                partita_version=field(d, "partita_version", str, ""),
                version=field(d, "version", int),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: int(Infinity)
            why = f"{type(e).__name__}: {e}" if not isinstance(e, KeyError) else "missing"
            raise PlanError(
                f"{source} is missing or has a malformed field {field.at!r} ({why}).",
                "recompile the plan; do not edit plan.json by hand.",
            ) from None
        validate(plan, source)
        return plan


def _unknown_keys(d: Mapping[str, Any], allowed: set[str], source: str, prefix: str) -> None:
    """A key no plan writes (a typo made by hand, a field of another version) is named, with the nearest
    one: read as it is, it would be ignored and the plan run as if it were not there."""
    import difflib

    for key in d:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise PlanError(
                f"{source} has the unknown field {prefix}{key!r}{hint}",
                "recompile the plan; do not edit plan.json by hand.",
            )


# training.* a plan's consumers read, with the values they take (search/pricing/config.TrainingConfig's)
TRAINING_DTYPES = ("bf16", "f16", "f32")
TRAINING_OPTIMIZERS = ("adam", "adamw", "sgd")


# the predictions the report and the run log print as numbers
PREDICTED_NUMBERS: tuple[str, ...] = (
    "step_time_s",
    "compute_s",
    "communication_s",
    "bubble_s",
    "tail_s",
    "mfu",
    "mfu_cluster",
)
PREDICTED_NUMBERS += ("tokens_per_s", "memory_usable", "devices_total", "devices_used")


class _NonFinite(ValueError):
    pass


def _no_constant(name: str) -> Any:
    """``json.loads``' hook for NaN / Infinity / -Infinity: no plan holds NaN (a prediction may be infinite)."""
    if name == "NaN":
        raise _NonFinite(name)
    return float(name)


_REQUIRED: Any = object()


class _FieldReader:
    """Reads one field of a plan file at a time, remembering which (``at``), so a malformed or missing
    one is named in the error: ``stages[1].tp``, not just "ValueError"."""

    def __init__(self) -> None:
        self.at = ""
        self.prefix = ""

    def __call__(self, d: Any, key: str, kind: Any, default: Any = _REQUIRED) -> Any:
        self.at = self.prefix + key
        if not isinstance(d, Mapping):
            raise TypeError(f"{self.prefix.rstrip('.') or 'the plan'} is {type(d).__name__}, not a mapping")
        if key not in d:
            if default is _REQUIRED:
                raise KeyError(key)
            return default
        v = d[key]
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
                raise ValueError(f"{v!r} is not an integer")
            return int(v)
        if kind is bool:
            if not isinstance(v, bool):
                raise TypeError(f"{v!r} is not true or false")
            return v
        if kind is str:
            if not isinstance(v, str):
                raise TypeError(f"{v!r} is not a string")
            return v
        if kind is dict:
            if not isinstance(v, Mapping):
                raise TypeError(f"{type(v).__name__} is not a mapping")
            return dict(v)
        if kind is list:
            if not isinstance(v, list):
                raise TypeError(f"{type(v).__name__} is not a list")
            return v
        return kind(v)


def _read_stage(field: _FieldReader, s: Any, k: int) -> Stage:
    field.prefix = f"stages[{k}]."
    stage = Stage(
        index=field(s, "index", int),
        layers=tuple(field(s, "layers", list)),
        device_type=field(s, "device_type", str),
        ranks=ranks_from_runs(field(s, "ranks", list)),
        dp=field(s, "dp", int),
        tp=field(s, "tp", int),
        zero_stage=field(s, "zero_stage", int, 0),
        recompute=field(s, "recompute", str, "none"),
        batch_shares=tuple(int(x) for x in field(s, "batch_shares", list, [])),
        replica_device_types=tuple(field(s, "replica_device_types", list, [])),
        param_placements={key: tuple(v) for key, v in field(s, "param_placements", dict, {}).items()},
        input_placement=tuple(field(s, "input_placement", list, ["S(0)", "R"])),
        output_placement=tuple(field(s, "output_placement", list, ["S(0)", "R"])),
        op_strategies=field(s, "op_strategies", dict, {}),
        tp_plan=field(s, "tp_plan", dict, {}),
        collectives=tuple(Collective(**c) for c in field(s, "collectives", list, [])),
        predicted=field(s, "predicted", dict, {}),
        cp=field(s, "cp", int, 1),
        fp8=field(s, "fp8", str, None),
        grad_buckets=tuple(tuple(str(n) for n in b) for b in field(s, "grad_buckets", list, [])),
    )
    said = field(s, "tp_shards_nothing", bool, stage.tp_shards_nothing)  # plans before issue 31 lack it
    if said is not stage.tp_shards_nothing:  # derived from the stage's fields: a file that disagrees was edited
        raise ValueError(f"{said!r} disagrees with the stage's placements and tp_plan ({stage.tp_shards_nothing!r})")
    field.prefix = ""
    return stage


def _check_buckets(plan: Plan, s: Stage, where: str) -> None:
    """Gradient buckets belong to a ZeRO-0 stage with dp > 1 of a plan whose program buckets (not ZB-V's
    chunks: :func:`flat_sync_chunks`), and name each parameter once."""
    zbv = flat_sync_chunks(plan.schedule, plan.num_virtual_stages)
    if s.dp * s.cp < 2 or s.zero_stage != 0 or zbv:
        raise PlanError(
            f"{where} lists gradient buckets, but only a ZeRO-0 stage with dp > 1 of a plan without ZB-V's model "
            f"chunks syncs its gradients in buckets (this stage: dp {s.dp}, ZeRO-{s.zero_stage}"
            f"{', ZB-V model chunks' if zbv else ''}).",
            "recompile the plan; do not edit plan.json by hand.",
        )
    names = [n for b in s.grad_buckets for n in b]
    if len(set(names)) != len(names) or not all(s.grad_buckets):
        raise PlanError(
            f"{where}: grad_buckets names a parameter twice or holds an empty bucket.",
            "recompile the plan; do not edit plan.json by hand.",
        )


def _legacy_fp8(training: Mapping[str, Any], raw: Any, stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """A plan written before stages said their precision (``training.fp8`` and no stage naming ``fp8``)
    converted every stage: read it so."""
    recipe = training.get("fp8")
    if not recipe or any(isinstance(st, Mapping) and "fp8" in st for st in raw):
        return stages
    return tuple(dataclasses.replace(s, fp8=str(recipe)) for s in stages)


RANK_RUNS_ABOVE = 64  # stages with more ranks write them as runs; smaller plans keep the plain list
MAX_RUN_RANKS = 1 << 24  # a run longer than any cluster is a corrupt file, not a reason to allocate


def rank_runs(ranks: Sequence[int]) -> list[Any]:
    """``ranks`` in plan.json form: a rank alone as an int, each ascending run of consecutive ranks
    as ``[first, last]`` (inclusive), e.g. ``(0, 1, 2, 3, 8)`` -> ``[[0, 3], 8]``; the order is kept."""
    out: list[Any] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append([int(ranks[i]), int(ranks[j])] if j > i else int(ranks[i]))
        i = j + 1
    return out


def ranks_from_runs(items: Any) -> tuple[int, ...]:
    """The inverse of :func:`rank_runs`; a plain list of ints (every plan written before runs) reads
    as itself. Raises ValueError / TypeError on anything else (the caller names the file)."""
    out: list[int] = []
    for x in items:
        if isinstance(x, list):
            first, last = (int(v) for v in x)  # exactly two numbers, else ValueError
            if last < first or last - first >= MAX_RUN_RANKS:
                raise ValueError(f"rank run {x} is not [first, last] with first <= last")
            out.extend(range(first, last + 1))
        else:
            out.append(int(x))
    return tuple(out)


def _cluster_from_json(cluster: Any) -> dict[str, Any]:
    """``plan.cluster`` with a ``rank_map`` written as runs read back as the plain list."""
    out = dict(cluster)
    if isinstance(out.get("rank_map"), list):
        out["rank_map"] = list(ranks_from_runs(out["rank_map"]))
    return out


def read_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; unreadable, binary or truncated files raise PlanError naming it."""
    from partita.user_files import read_user_text

    path = Path(path)
    text = read_user_text(path, "plan", "recompile with `partita compile ... --out DIR`.", PlanError)
    return Plan.from_json(text, str(path))


def _device_names(cluster: Mapping[str, Any]) -> set[str]:
    """The device types of a plan's cluster (``cluster.spec.groups[*].device.name``); empty if unknown."""
    spec = cluster.get("spec")
    groups = spec.get("groups") if isinstance(spec, Mapping) else None
    if not isinstance(groups, list):
        return set()
    names = set()
    for g in groups:
        dev = g.get("device") if isinstance(g, Mapping) else None
        if isinstance(dev, Mapping) and isinstance(dev.get("name"), str):
            names.add(dev["name"])
    return names


def validate(plan: Plan, source: str = "plan") -> None:
    """Structural checks every consumer relies on; raise PlanError naming the field."""
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"{source}: schedule {plan.schedule!r} is unknown.", f"use one of {SCHEDULES}.")
    if plan.micro_batch_size < 1 or plan.num_micro_batches < 1:
        raise PlanError(f"{source}: micro_batch_size and num_micro_batches must be >= 1.", "recompile the plan.")
    batch = plan.training.get("global_batch")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"{source}: training.global_batch is {batch!r}, not a positive integer.", "recompile the plan.")
    seq = plan.training.get("seq_len", 1)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:  # 0: a model without a sequence
        raise PlanError(f"{source}: training.seq_len is {seq!r}, not a sequence length.", "recompile the plan.")
    layers_named = plan.model.get("layers")
    if not isinstance(layers_named, list) or not all(isinstance(x, str) for x in layers_named):
        raise PlanError(
            f"{source}: model.layers is {layers_named!r}, not the list of the model's layer names.",
            "recompile the plan; do not edit plan.json by hand.",
        )
    for key in PREDICTED_NUMBERS:
        v = plan.predicted.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise PlanError(
                f"{source}: predicted.{key} is {v!r}, not a number.",
                "recompile the plan; do not edit plan.json by hand.",
            )
    for key, allowed in (("dtype", TRAINING_DTYPES), ("optimizer", TRAINING_OPTIMIZERS)):
        if key in plan.training and plan.training[key] not in allowed:
            raise PlanError(
                f"{source}: training.{key} is {plan.training[key]!r}, not one of {', '.join(allowed)}.",
                "recompile the plan; do not edit plan.json by hand.",
            )
    known = _device_names(plan.cluster)
    for s in plan.stages:
        for name in (s.device_type, *s.replica_device_types):
            if known and name not in known and name != "mixed":
                raise PlanError(
                    f"{source}: stage {s.index} runs on device type {name!r}, which the plan's cluster does not "
                    f"have ({', '.join(sorted(known))}).",
                    "recompile the plan for the cluster it runs on; do not edit plan.json by hand.",
                )
    seen: set[int] = set()
    layers: list[str] = []
    for s in plan.stages:  # before the chunk checks: a rank listed twice in one stage is not a chunk
        if len(set(s.ranks)) != len(s.ranks):
            dup = sorted({r for r in s.ranks if s.ranks.count(r) > 1})
            raise PlanError(
                f"{source}: stage {s.index} lists ranks {dup} more than once.", "each rank is in one stage, once."
            )
    first_chunk = _check_chunks(plan, source) if plan.chunked else {}
    for s in plan.stages:
        where = f"{source}: stage {s.index}"
        if s.cp != 1:
            _check_cp(plan, s, where)
        if s.grad_buckets:
            _check_buckets(plan, s, where)
        if s.fp8 is not None and s.fp8 != plan.training.get("fp8"):
            raise PlanError(
                f"{where} trains in fp8 ({s.fp8!r}) but training.fp8 is {plan.training.get('fp8')!r}: a plan's "
                "fp8 stages run the one recipe training.fp8 names.",
                "recompile the plan with --precision fp8; do not edit plan.json by hand.",
            )
        if s.dp < 1 or s.tp < 1 or len(s.ranks) != s.dp * s.cp * s.tp:
            cp = f", cp={s.cp}" if s.cp != 1 else ""
            need = "dp*cp*tp" if s.cp != 1 else "dp*tp"
            raise PlanError(f"{where} has dp={s.dp}{cp}, tp={s.tp} but {len(s.ranks)} ranks.", f"need {need} ranks.")
        if seen & set(s.ranks) and s.index not in first_chunk:
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


def _check_cp(plan: Plan, s: Stage, where: str) -> None:
    """A stage's context-parallel degree: at least 1, the same on every stage (the sequence is split once,
    before the first stage; a pipeline boundary passes each rank its own slice), dividing the sequence."""
    fix = "recompile the plan; do not edit plan.json by hand."
    if s.cp < 1:
        raise PlanError(f"{where} has cp={s.cp}; context parallelism splits the sequence over cp >= 1 ranks.", fix)
    seq = plan.training.get("seq_len")
    if isinstance(seq, int) and not isinstance(seq, bool) and seq % s.cp:
        raise PlanError(
            f"{where} has cp={s.cp}, which does not divide training.seq_len={seq}: every rank of a "
            "context-parallel group holds the same number of tokens.",
            fix,
        )
    others = sorted({t.cp for t in plan.stages} - {s.cp})
    if others:
        raise PlanError(
            f"{where} has cp={s.cp} but other stages have cp={others}: the sequence is split once for the "
            "whole pipeline.",
            fix,
        )


def _chunk_key(s: Stage) -> tuple:
    """What the chunks of one rank group share (one setup_stage builds them all)."""
    return (s.ranks, s.dp, s.cp, s.tp, s.batch_shares, s.zero_stage, s.device_type, s.replica_device_types, s.fp8)


def _check_chunks(plan: Plan, source: str) -> dict[int, Stage]:
    """A chunked plan (stages sharing ranks): the schedule places chunks, every chunk repeats its
    position's ranks and mesh, positions are disjoint. Returns chunk index -> its position's first
    chunk, for the chunks after the first (whose ranks repeat)."""
    v = chunks_per_rank(plan.schedule, plan.num_virtual_stages)
    n = len(plan.stages)
    if v < 2 or n % v or n // v < 2:
        raise PlanError(
            f"{source}: stages share ranks (model chunks), but schedule {plan.schedule} with num_virtual_stages="
            f"{plan.num_virtual_stages} places {v} chunk(s) per rank group and there are {n} stages.",
            "chunks need interleaved_1f1b (v >= 2) or zbv (v = 2), v * p stages for p >= 2 rank groups; "
            "recompile the plan.",
        )
    p, out = n // v, {}
    for r, group in enumerate(plan.positions()):
        head = group[0]
        for s in group[1:]:
            if _chunk_key(s) != _chunk_key(head):
                raise PlanError(
                    f"{source}: stage {s.index} is chunk of pipeline position {r} under {plan.schedule} "
                    f"(p={p}), but its ranks/mesh/ZeRO/batch shares/fp8 differ from stage {head.index}'s.",
                    "every chunk of a rank group repeats that group's ranks, mesh, ZeRO stage and shares; "
                    "recompile the plan.",
                )
            out[s.index] = head
    heads = [g[0] for g in plan.positions()]
    for a in heads:
        for b in heads:
            if a.index < b.index and set(a.ranks) & set(b.ranks):
                raise PlanError(
                    f"{source}: stages {a.index} and {b.index} are different pipeline positions under "
                    f"{plan.schedule} (p={p}) but share ranks {sorted(set(a.ranks) & set(b.ranks))}.",
                    "each rank is in one pipeline position; recompile the plan.",
                )
    return out


def shares(stage: Stage, micro_batch_size: int) -> tuple[int, ...]:
    """Per-replica samples per micro-batch (even split when the plan gives none)."""
    return stage.batch_shares or (micro_batch_size,) * stage.dp


def placements_to_str(p: Sequence[str]) -> str:
    return "(" + ", ".join(p) + ")"
