"""Plan -> one readable PyTorch program (``DIR/program_torch.py``) that trains under torchrun.

Called by ``driver.py`` after the search. The program reads top to bottom: the plan as
literal data (``PROGRAM``: meshes, layers, ZeRO, recompute, batch shares, predicted collectives),
one ``setup_stage_<i>`` per stage with the per-parameter placements written out, ``make_runner``
with the schedule, ``lr_lambda``, and a ``__main__`` that hands these to
``partita.backends.torch.train.main``. Same plan -> byte-identical program (golden-tested).

The predicted collectives are the plan's own records (``search/program/records.py``: per stage and step, by
kind, mesh axis and bytes), written as ``PROGRAM["predicted_collectives"]``; nothing here predicts.
For tensor parallelism the emitter derives the module roles (``backends/torch/tp.py``) on the model
built on the meta device and writes them into the program; the program re-derives them and refuses to
run if they differ. A spec that cannot be built here (an in-memory module) gets no roles: the program
derives them at run time.

Precision (issue 15 item 2): the program trains in the plan's ``training["dtype"]``. A bf16/f16 stage
under FSDP2 (ZeRO >= 1, dp > 1) gets ``MixedPrecisionPolicy(param_dtype=<dtype>,
reduce_dtype=torch.float32)`` on every ``fully_shard``; any other stage ``tpar.apply_autocast``
(f32 master parameters, ``torch.autocast`` compute, activations handed on in the dtype, so p2p
boundaries travel in it). ``PROGRAM["stages"][i]["precision"]`` names the mode, and
``train.reference_run(precision=...)`` computes the same way. f16 scales the loss dynamically
(``optim.LossScaler``); its overflow check is one more all-reduce per step, which the plan records.

What torch cannot express, and what the program does instead (also written into the file):

* ZeRO-1: FSDP2 cannot keep a full parameter copy between steps. The program keeps parameters
  gathered for the whole step, lets gradients accumulate unsharded, reduce-scatters them once
  after the last micro-batch and steps the optimizer on the dp shard: ZeRO-1's communication (one
  all-gather + one reduce-scatter per FSDP unit and step, an all-reduce's volume) and optimizer
  memory; between steps only the shard is kept (less memory than ZeRO-1, never more).
  ``ZeroRedundancyOptimizer`` keeps replicas, but all-reduces the gradients and then broadcasts
  every parameter from its owner: not the reduce-scatter the plan prices.
* a fused weight the model splits after the matmul (GPT-2's q|k|v ``c_attn``): the search places
  it ``"SS(d,g)"`` (``passes/fused_split.py``), applied as DTensor's private ``_StridedShard``
  through ``frontends/torch_shim.py``, so each rank holds whole heads and attention runs on them;
  a contiguous ``S(d)`` (a hand-made plan) does not hold whole heads, so that output is
  all-gathered and attention runs on all heads (``torch_tp`` role ``colwise_gather``).
* ZeRO with ``torch.distributed.pipelining`` (equal-shape stages): the schedule drives FSDP2's
  gradient sync itself (reduce-scatter and reshard only after the last micro-batch), which is ZeRO-1,
  not the ZeRO-2/3 the plan prices (sharded gradients / parameters per micro-batch). A pipelined plan
  with a ZeRO-2/3 stage therefore runs ``torch_schedule.P2PPipeline``, which sets FSDP2 up per
  micro-batch as the plan's ZeRO level says (``torch_schedule.zero_micro_batch``; issue 15 item 6).
* stages of different shapes: ``torch.distributed.pipelining`` needs one equal-shape stage per pp
  rank, so such plans run ``torch_schedule.P2PPipeline`` (explicit send/recv).
* ``interleaved_1f1b`` with ``num_virtual_stages > 1`` and ``zbv`` (2 chunks per rank in a V): run when
  the plan lays the chunks out (``Plan.chunked``: one Stage per virtual stage, chunks of a rank group
  repeating its ranks): ``backends/torch/chunks.py`` merges each rank group's chunks into one
  ``setup_stage`` (one module, one optimizer, one gradient sync), ``PROGRAM["chunks"]`` names each
  virtual stage's layers and rank group, and ``P2PPipeline`` runs the action list chunk by chunk (a
  hand-off between two chunks of one rank is local); ZeRO-1 reduce-scatters once, after the rank's last
  action (as for zb_h1). Refused when the plan priced chunks but lists one layer range per rank group,
  with ZeRO-2/3 on dp > 1 (FSDP2 would sync a unit's gradients at the last backward of one chunk while
  the rank's other chunks still accumulate), and for models cut by the generic splitter (one
  contiguous range per rank).
* ``zb_h1`` (and any schedule beyond GPipe / 1F1B): ``torch.distributed.pipelining`` runs zero-bubble
  schedules only with several stages per rank, so the plan runs ``torch_schedule.P2PPipeline``, which
  executes the rank's action list, written into ``make_runner`` as ``ACTIONS``
  (``search/schedule.pipeline_actions``). B computes only the input gradient, W the weight gradients
  (``backends/torch/wsplit.py``, one backward's FLOPs). ZeRO-1 reduce-scatters once, after the stage's
  last W (FSDP2's post-backward called then, as pipelining's REDUCE_GRAD does). Refused with ZeRO-2/3
  (dp > 1: per-micro-batch syncs would run after B, before W) and with activation recompute (W would
  recompute each block again).

Context parallelism (``Stage.cp > 1``, issue 36): the stage's mesh is ``(dp, cp, tp)``, its
``setup_stage`` calls ``cpr.split_sequence(module, rt.mesh["cp"], seq_len=S)`` (``backends/torch/
context_parallel.py``: attention with K/V all-gathered over cp, global rotary positions, labels shifted
before the split), and parameters are replicated over ``dp x cp``: the ZeRO-0 all-reduce and FSDP2 run
over ``rt.replicas`` (the ``dp_cp`` group). Built for Llama models at tp 1, alone or in a pipeline on
``torch.distributed.pipelining``; :func:`check_cp` refuses the rest.
"""

from __future__ import annotations

import dataclasses
import pprint
from typing import Any

from partita.backends.torch import chunks as vchunks
from partita.backends.torch import launch as torch_launch
from partita.errors import PartitaError, PlanError
from partita.plan import Plan, Stage, shares
from partita.search.pipeline.schedule import pipeline_actions, splits_backward
from partita.search.program import context_parallel as cp_records
from partita.search.program import records

_HEADER = '''"""Partita program: {model} on {cluster} ({world} ranks), {num_stages} stage(s), schedule {schedule}.

Generated by partita.backends.torch.emit from the plan (graph {graph}, cluster {fingerprint}).
Run:  partita run DIR --steps N      or:  {launch}

{stage_lines}
Global batch {global_batch} = {num_micro} micro-batches x {mb_total} samples; seq {seq}; optimizer {optimizer}.
"""

from torch.distributed.fsdp import fully_shard

from partita.backends.torch import parallel as tpar
from partita.backends.torch import schedule as torch_schedule, train as torch_train
'''


TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # interleaved only with 1 virtual stage (= 1F1B)


def _runner_kind(plan: Plan) -> str:
    """``local``, ``torch_pipeline`` or ``p2p``: ``search/records.runner_kind``, the one definition, so
    the plan's records price the runner that runs. ``p2p`` for stages of different shapes, for
    ZeRO-2/3 (pipelining's schedule would defer the per-micro-batch sync: module docstring) and for
    every schedule beyond GPipe / 1F1B (its action list runs on ``P2PPipeline``)."""
    return records.runner_kind(plan)


def _device_kind(plan: Plan, name: str) -> str:
    """``cpu`` or ``gpu`` for a device type name, from the plan's cluster spec (name as fallback)."""
    for g in plan.cluster.get("spec", {}).get("groups", []):
        if g.get("device", {}).get("name") == name:
            return str(g["device"].get("kind", "gpu"))
    return "cpu" if name.upper().startswith("CPU") else "gpu"


LOW_DTYPES = {"bf16": "torch.bfloat16", "f16": "torch.float16"}


def _precision(plan: Plan, s: Stage) -> str:
    """``parallel.precision_of`` without importing torch: f32, fsdp (MixedPrecisionPolicy) or autocast."""
    if plan.training.get("dtype", "f32") not in LOW_DTYPES:
        return "f32"
    return "fsdp" if s.dp > 1 and s.zero_stage > 0 else "autocast"


def _stage_dict(plan: Plan, s: Stage) -> dict[str, Any]:
    kinds = {_device_kind(plan, t) for t in (s.replica_device_types or (s.device_type,)) if t != "mixed"}
    kind = "cpu" if kinds == {"cpu"} else "gpu"
    return {
        "index": s.index,
        "layers": list(s.layers),
        "ranks": list(s.ranks),
        "dp": s.dp,
        **({"cp": s.cp} if s.cp > 1 else {}),  # context parallelism (written only when used: older programs unchanged)
        "tp": s.tp,
        "device_type": s.device_type,
        "kind": kind,
        "zero_stage": s.zero_stage,
        "recompute": s.recompute,
        "shares": list(shares(s, plan.micro_batch_size)),
        "precision": _precision(plan, s),
        **({"fp8": s.fp8} if s.fp8 else {}),  # Stage.fp8: this stage's linears in FP8 (bf16 stages: absent)
    }


def _meta_model(model_spec: str) -> Any:
    """The model built on the meta device (nothing allocated), or None when the spec cannot be built."""
    try:
        from partita.models.zoo import resolve_model

        return resolve_model(model_spec).build("meta")
    except (PartitaError, ImportError, AttributeError, TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class StageFacts:
    """What the emitter reads off the (meta) model for one stage; ``None``: model unknown or tp = 1."""

    roles: dict[str, str] | None  # tp module path -> torch_tp role


def tp_placements(s: Stage) -> dict[str, str]:
    """The stage's parameter placements on the ``tp`` axis (PlanError if a placement is not 2-D)."""
    out = {}
    for fqn, pl in sorted(s.param_placements.items()):
        if len(pl) != 2:
            raise PlanError(
                f"stage {s.index}: placement {tuple(pl)} of {fqn} has {len(pl)} entries, the mesh has 2 axes (dp, tp).",
                "recompile the plan.",
            )
        out[fqn] = str(pl[1])
    return out


def stage_facts(plan: Plan, model: Any) -> list[StageFacts]:
    """Module roles per stage (None for tp = 1): the plan's ``tp_plan`` where it has one (the search
    writes each stage's own modules' roles), else derived on ``model`` (None without one)."""
    if model is None or all(s.tp_plan for s in plan.stages if s.tp > 1):
        return [StageFacts(dict(sorted(s.tp_plan.items())) if s.tp > 1 and s.tp_plan else None) for s in plan.stages]
    from partita.backends.torch import parallel as tpar

    out = []
    for s in plan.stages:
        paths = {p for name in s.layers for p in tpar.layer_paths(model, name)}
        roles = None
        if s.tp > 1:
            roles = {p: r for p, r in tpar.tp_roles(model, tp_placements(s), s.tp_plan).items() if _within(p, paths)}
        out.append(StageFacts(roles))
    return out


def _within(fqn: str, paths: Any) -> bool:
    """Is ``fqn`` one of the module ``paths`` or inside one?"""
    return any(fqn == p or fqn.startswith(p + ".") for p in paths)


def _program(plan: Plan, model_spec: str, facts: list[StageFacts]) -> dict[str, Any]:
    prog = {
        "model": model_spec,
        "world_size": plan.world_size,
        "training": dict(plan.training),
        "schedule": plan.schedule,
        "micro_batch_size": plan.micro_batch_size,
        "num_micro_batches": plan.num_micro_batches,
        "runner": _runner_kind(plan),
        "layers": [name for s in plan.stages for name in s.layers],
        "stages": [_stage_dict(plan, s) for s in plan.stages],
        # the plan's own records (search/program/records.py), the program's one prediction: train.py compares its
        # first and last counted steps with them (kinds, axes, counts, bytes)
        "predicted_collectives": {f"stage{s.index}": records.summary(s.collectives) for s in plan.stages},
        "predicted_step_time_s": plan.predicted.get("step_time_s"),
    }
    return prog


def _tp_lines(s: Stage, facts: StageFacts) -> list[str]:
    lines = [
        f'    # Tensor parallel over mesh["tp"] ({s.tp} ranks), Megatron-style (backends/torch/tp.py): the modules',
        "    # below run on DTensors (parameters with their tp placement), activations between modules stay local.",
        "    # colwise: Replicate in, Shard(-1) out (backward all-reduce of the input grad, one per parent module);",
        "    # rowwise: Shard(-1) in, all-reduce out; *_gather / *_replicated add an all-gather; vocab: all-reduce out.",
    ]
    pls = tp_placements(s)
    if not pls:
        lines.append("    # The plan gives no per-parameter placements: every parameter is replicated on tp.")
    call = "roles = tpar.distribute_params" if s.tp_shards_nothing else "tpar.distribute_params"
    lines.append(f'    {call}(module, rt.mesh["tp"], {{')
    for fqn, pl in pls.items():
        lines.append(f"        {fqn!r}: {pl!r},  # plan (dp, tp) = ({s.param_placements[fqn][0]}, {pl})")
    roles = facts.roles if facts.roles is not None else (dict(s.tp_plan) or None)
    if s.tp_shards_nothing:  # plan.json's stage field (issue 31): said here and checked at set-up
        lines += [
            "    }, roles={})",
            f"    # plan.json: tp_shards_nothing. The plan places nothing of this stage on tp: each of the {s.tp} tp ranks",
            "    # holds and computes the whole stage on the same batch (no tp collectives; the gradients agree over tp).",
            "    tpar.check_tp_shards_nothing(module, roles)",
        ]
        return lines
    if roles is None:
        lines.append("    })  # roles: derived at run time (the model could not be built when this was emitted)")
        return lines
    lines.append("    }, roles={  # the plan's tp_plan: the ILP's role per module" if s.tp_plan else "    }, roles={")
    lines += [f"        {p!r}: {r!r}," for p, r in sorted(roles.items())]
    lines.append("    })")
    return lines


def _mesh_text(s: Stage) -> tuple[str, str]:
    """``(dp=2, tp=1)`` and ``2x1, ("dp", "tp")``; with the cp axis when ``s.cp > 1``."""
    if s.cp == 1:
        return f"(dp={s.dp}, tp={s.tp})", f'{s.dp}x{s.tp}, ("dp", "tp")'
    return f"(dp={s.dp}, cp={s.cp}, tp={s.tp})", f'{s.dp}x{s.cp}x{s.tp}, ("dp", "cp", "tp")'


def _cp_lines(plan: Plan, s: Stage) -> list[str]:
    """A cp stage's sequence split (``backends/torch/context_parallel.py``), written into ``setup_stage``."""
    seq = int(plan.training["seq_len"])
    return [
        f'    # Context parallel over mesh["cp"] ({s.cp} ranks): each rank holds {seq // s.cp} consecutive tokens of its',
        f"    # replica's {seq}-token sequences (cp rank r: tokens r*{seq // s.cp} ..); labels are shifted over the whole",
        "    # sequence before the split, rotary positions are global, and attention all-gathers K and V over cp",
        "    # (their gradients reduce-scattered in backward). torch_train applies rt.sequence to every micro-batch.",
        f'    rt.sequence = cpr.split_sequence(module, rt.mesh["cp"], seq_len={seq})',
    ]


def _fused_lines(plan: Plan, s: Stage) -> list[str]:
    """A low-dtype stage's RMSNorms and SwiGLU products as fused ops (``backends/torch/fused.py``; priced by
    ``search/layer/saved.py``): written for every bf16 / f16 stage, a no-op for a model without them
    (GPT-2's LayerNorm and GeLU already keep only their inputs)."""
    if _precision(plan, s) not in ("fsdp", "autocast"):
        return []
    held = "f32 under autocast" if _precision(plan, s) == "autocast" else plan.training["dtype"]
    return [
        "    # Fused ops, as Megatron-LM keeps them (none in a model without them): each RMSNorm keeps its",
        f"    # input ({held}) and a per-row f32 statistic, not Hugging Face's f32 copies; each SwiGLU keeps",
        "    # gate's and up's outputs and recomputes SiLU in the backward.",
        "    fused.fuse_ops(module)",
    ]


def _setup_stage(plan: Plan, s: Stage, facts: StageFacts) -> str:
    mesh, shape = _mesh_text(s)
    lines = [
        f"# ---- stage {s.index}: ranks {list(s.ranks)} as mesh {mesh} on {s.device_type} ----",
        f"def setup_stage_{s.index}(model, rt):",
        f'    """Layers {", ".join(s.layers)}; mesh rt.mesh = DeviceMesh({list(s.ranks)} as {shape})."""',
        f'    module = tpar.split_stage(model, {list(s.layers)!r}, PROGRAM["layers"], rt.device)',
    ]
    if s.cp > 1:
        lines += _cp_lines(plan, s)
    lines += _fused_lines(plan, s)
    recipe = s.fp8
    if recipe:
        lines += [
            f"    # Stage.fp8 = {recipe!r} (search/pricing/fp8.py): torchao swaps each nn.Linear whose sizes are",
            "    # multiples of 16 for a Float8Linear: its three GEMMs in FP8 with dynamic scales; weights stay the master",
            "    # copy and the optimizer state is the plan's (f32 masters under bf16 compute).",
            "    convert_to_float8_training, Float8LinearConfig = fp8.torchao_float8()  # one paragraph, exit 2, without torchao",
            "    module = convert_to_float8_training(",
            f"        module, config=Float8LinearConfig.from_recipe_name({recipe!r}), module_filter_fn=fp8.runs_in_fp8",
            "    )",
        ]
    elif plan.training.get("fp8"):
        lines.append("    # Stage.fp8 unset: this stage trains in bf16 (its device type has no FP8 tensor cores).")
    if s.tp > 1:
        lines += _tp_lines(s, facts)
    else:
        lines.append("    # tp = 1: parameters stay plain tensors (no tensor parallelism in this stage).")
    if s.recompute != "none":
        what = (
            "each block is recomputed in backward" if s.recompute == "full" else "matmul outputs kept, rest recomputed"
        )
        lines.append(f"    tpar.apply_recompute(module, {s.recompute!r})  # activation checkpointing: {what}")
    dtype = str(plan.training.get("dtype", "f32"))
    mp = ""
    if _precision(plan, s) == "fsdp":
        lines += [
            f"    # Plan dtype {dtype}: FSDP2 casts the parameters to {dtype} for forward and backward and reduces and keeps",
            "    # gradients in f32 (optimizer on f32 master shards).",
            f"    mp = MixedPrecisionPolicy(param_dtype={LOW_DTYPES[dtype]}, reduce_dtype=torch.float32)",
        ]
        mp = ", mp_policy=mp"
    elif _precision(plan, s) == "autocast":
        lines.append(
            f"    tpar.apply_autocast(module, {dtype!r})  # plan dtype {dtype}: f32 master parameters, "
            f"torch.autocast({dtype}) compute, activations leave in {dtype}"
        )
    replicas, dp_mesh = s.dp * s.cp, 'rt.mesh["dp"]' if s.cp == 1 else "rt.replicas"
    over = f'mesh["dp"] ({s.dp} replicas)' if s.cp == 1 else f'rt.replicas ("dp_cp": {s.dp} dp x {s.cp} cp ranks)'
    if replicas > 1 and s.zero_stage > 0:
        reshard = s.zero_stage == 3
        note = {
            1: "ZeRO-1: optimizer state on the dp shard; parameters gathered for the whole step, gradients\n"
            "    # accumulated unsharded and reduce-scattered once after the last micro-batch (torch_schedule)",
            2: "ZeRO-2: gradients reduce-scattered every micro-batch, parameters gathered for the whole step",
            3: "ZeRO-3: parameters, gradients and optimizer state sharded; parameters re-gathered for backward",
        }[s.zero_stage]
        lines += [
            f"    # {note}; FSDP2 over {over}, one unit per block + the stage root.",
            "    for block in module.blocks():",
            f"        rt.fsdp_modules.append(fully_shard(block, mesh={dp_mesh}, reshard_after_forward={reshard}{mp}))",
            f"    rt.fsdp_modules.append(fully_shard(module, mesh={dp_mesh}, reshard_after_forward={reshard}{mp}))",
            f"    # FSDP2 averages gradients over {'dp' if s.cp == 1 else 'dp_cp'}; losses are pre-weighted by batch share, "
            "so torch_train multiplies",
            f"    # the sharded gradients by {replicas} after backward (set_gradient_divide_factor(1) needs PREMUL_SUM: no gloo).",
        ]
    elif replicas > 1 and s.grad_buckets:
        lines += _bucket_lines(plan, s, over)
    elif replicas > 1:
        shr = list(shares(s, plan.micro_batch_size))
        lines.append(
            f"    # Data parallel, ZeRO-0, {s.dp} replicas with batch shares {shr}: torch_train all-reduces (SUM) each"
        )
        if s.cp == 1:
            lines.append(
                '    # gradient over mesh["dp"] after backward; losses are weighted by share, so the sum is the mean.'
            )
        else:
            lines.append(
                f'    # gradient over rt.replicas ("dp_cp": the {replicas} dp x cp ranks, parameters replicated on both) after'
            )
            lines.append(
                "    # backward; each rank's loss is its targets' share of the global mean, so the sum is the mean."
            )
    elif s.zero_stage > 0:
        lines.append(f"    # ZeRO-{s.zero_stage} asked with dp = 1: nothing to shard over, no fully_shard.")
    lines.append("    return module")
    return "\n".join(lines)


def _bucket_lines(plan: Plan, s: Stage, over: str) -> list[str]:
    """``Stage.grad_buckets`` written literally: the parameter names of each bucket, in the order the
    backward finishes them (``backends/torch/grad_buckets.py``)."""
    shr = list(shares(s, plan.micro_batch_size))
    lines = [
        f"    # Data parallel, ZeRO-0, {s.dp} replicas with batch shares {shr}: the gradients are all-reduced (SUM) over",
        f"    # {over} in the plan's {len(s.grad_buckets)} bucket(s) (Stage.grad_buckets, below: parameter names), each issued",
        "    # inside the stage's last backward as soon as its gradients are made (post-accumulate-grad hooks;",
        "    # with model chunks: each chunk's buckets in its own last backward, the last chunk's first),",
        "    # waited for before the optimizer step; losses are weighted by share, so the sum is the mean.",
        "    rt.grad_buckets = tpar.GradBuckets(",
        "        [",
    ]
    for b in s.grad_buckets:
        one = f"            {list(b)!r},"
        lines += (
            [one] if len(one) <= 110 else ["            [", *(f"                {n!r}," for n in b), "            ],"]
        )
    lines += [
        "        ],",
        f"        num_micro_batches={plan.num_micro_batches},",
        f"        stage_index={s.index},",
        "    )",
    ]
    return lines


def _make_runner(plan: Plan, kind: str) -> str:
    m, n = plan.num_micro_batches, plan.num_positions
    sched = "1f1b" if plan.schedule == "interleaved_1f1b" and not plan.chunked else plan.schedule
    head = ["def make_runner(rt):"]
    if kind == "local":
        body = [
            f"    # One stage: gradient accumulation over {m} micro-batch(es) (schedule {plan.schedule!r} has no pipeline).",
            f'    return torch_schedule.LocalSchedule(rt.module, {m}, rt.loss_fn, rt.fsdp_modules, rt.stage["zero_stage"])',
        ]
    elif kind == "torch_pipeline":
        cls = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[sched]
        body = [
            f"    # {plan.schedule} over {n} equal-shape stages, {m} micro-batches: torch.distributed.pipelining.{cls}",
            "    # on the pp group joining the ranks at this rank's (dp, tp) coordinate in every stage.",
            "    x, out = rt.examples()",
            f'    return torch_schedule.TorchPipeline(rt.module, rt.stage["index"], {n}, rt.device, rt.pp_group, '
            f"{sched!r}, {m}, rt.loss_fn, x, out)",
        ]
    else:
        if plan.chunked:
            why = [
                f"    # {plan.schedule} over {n} rank groups with {len(plan.stages)} model chunks (virtual stages): this",
                "    # rank's module holds the layers of all its chunks; torch_schedule.P2PPipeline runs each action on",
                "    # its chunk's layers (PROGRAM['chunks']), moves boundaries between rank groups with dist.isend/recv",
                "    # and hands them over locally between two chunks of this rank.",
                *["    # " + line for line in vchunks.placement_lines(plan)],
            ]
        elif plan.schedule not in TORCH_SCHEDULES:
            why = [
                f"    # {plan.schedule} over {n} stages: torch.distributed.pipelining runs zero-bubble schedules only with",
                "    # several stages per rank, so boundary activations move with explicit dist.isend/recv",
                "    # (torch_schedule.P2PPipeline), which executes the action list below; B computes only the input",
                "    # gradient and W the weight gradients later, one backward's FLOPs in all (backends/torch/wsplit.py).",
            ]
        elif any(s.dp > 1 and s.zero_stage >= 2 for s in plan.stages):
            why = [
                f"    # {plan.schedule} over {n} stages with ZeRO-2/3: torch.distributed.pipelining would defer FSDP2's",
                "    # gradient sync to the last micro-batch, so boundary activations move with explicit",
                "    # dist.isend/recv (torch_schedule.P2PPipeline), which reduce-scatters every micro-batch.",
            ]
        else:
            why = [
                f"    # {plan.schedule} over {n} stages of different (dp, tp): torch.distributed.pipelining cannot place",
                "    # them, so boundary activations move with explicit dist.isend/recv (torch_schedule.P2PPipeline).",
            ]
        body = [
            *why,
            *_action_lines(plan, sched),
            "    return torch_schedule.P2PPipeline(",
            f'        rt.module, PROGRAM["stages"], rt.stage["index"], rt.rank, {sched!r}, {m}, rt.loss_fn,',
            f'        {_boundary(plan)}, rt.device, rt.fsdp_modules, rt.stage["zero_stage"], ACTIONS[rt.stage["index"]],',
            *(['        chunks=PROGRAM["chunks"],'] if plan.chunked else []),
            "    )",
        ]
    return "\n".join(head + body)


def _action_lines(plan: Plan, schedule: str) -> list[str]:
    """The schedule as data: ``ACTIONS[i]`` is pipeline position ``i``'s action list, in execution order."""
    split = splits_backward(schedule)
    lines = [
        "    # The schedule as data (search/schedule.pipeline_actions, the list the cost model simulates):",
        "    # per pipeline position, in execution order, <kind><stage>.<micro-batch>: F forward, B backward",
        "    # (input gradient only), W weight gradient." if split else "    # (the whole backward: no W).",
        "    ACTIONS = [",
    ]
    v = len(plan.stages) // plan.num_positions
    per_rank = pipeline_actions(schedule, plan.num_positions, plan.num_micro_batches, v)
    for group, acts in zip(plan.positions(), per_rank):
        words = [str(a) for a in acts]
        lines.append(f"        # stage {', '.join(str(s.index) for s in group)}, ranks {list(group[0].ranks)}")
        chunks = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
        for c, text in enumerate(chunks):
            tail = " " if c < len(chunks) - 1 else ""
            lines.append(f'        "{text}{tail}"' + ("," if c == len(chunks) - 1 else ""))
    lines.append("    ]")
    return lines


def _boundary(plan: Plan) -> str:
    dtype = str(plan.training.get("dtype", "f32"))
    return f"tpar.boundary_in(rt.boundary, {dtype!r})" if dtype in LOW_DTYPES else "rt.boundary"


def check_schedule(plan: Plan) -> None:
    """Refuse (PlanError) a pipeline schedule this runtime cannot run for ``plan`` (module docstring):
    virtual stages (interleaved with v > 1, zbv), and zb_h1 with ZeRO-2/3 or activation recompute."""
    refit = "recompile with the default search (`partita compile`), or with SearchOptions(schedules=('1f1b',))"
    if plan.chunked:
        fsdp = [s.index for s in plan.stages if s.dp > 1 and s.zero_stage >= 2]
        if fsdp:
            raise PlanError(
                f"schedule {plan.schedule} runs several model chunks per rank, but stage(s) {fsdp} use ZeRO-2/3, "
                "which reduce-scatter (and reshard) gradients per backward while the rank's other chunks still "
                "accumulate theirs.",
                refit + ", or set ZeRO-0/1 on those stages.",
            )
    elif (plan.schedule == "interleaved_1f1b" and plan.num_virtual_stages > 1) or plan.schedule == "zbv":
        v = plan.num_virtual_stages if plan.schedule == "interleaved_1f1b" else 2
        raise PlanError(
            f"schedule {plan.schedule} with {v} virtual stages per rank cannot be emitted for PyTorch: each plan "
            "stage holds one contiguous layer range on its own ranks; the plan does not lay out the model chunks "
            "(one Stage per virtual stage, the chunks of a rank group repeating its ranks).",
            refit + " from Python.",
        )
    if plan.num_stages == 1 or not splits_backward(plan.schedule):
        return
    fsdp = [s.index for s in plan.stages if s.dp > 1 and s.zero_stage >= 2]
    recompute = [s.index for s in plan.stages if s.recompute != "none"]
    if fsdp or recompute:
        what = (
            f"stage(s) {fsdp} use ZeRO-2/3, which reduce-scatter (and reshard) a unit's gradients after every "
            "micro-batch's B, before its W has computed them"
            if fsdp
            else f"stage(s) {recompute} recompute activations, and W would recompute each block a second time "
            "(more FLOPs than the plan prices)"
        )
        raise PlanError(
            f"schedule {plan.schedule} splits the backward into B (input gradient) and W (weight gradients), "
            f"but {what}.",
            refit + ", or set ZeRO-0/1 and no recompute on those stages.",
        )


def check_cp(plan: Plan, model_spec: str) -> None:
    """Refuse (PlanError) a context-parallel plan this runtime does not build (:func:`check_cp_layout`)."""
    cps = [s for s in plan.stages if s.cp > 1]
    if cps:
        cp_records.check(plan)  # selective recompute
        tp, zero = max(s.tp for s in plan.stages), max(s.zero_stage for s in plan.stages)
        check_cp_layout(model_spec, cp=cps[0].cp, tp=tp, pp=plan.num_stages, zero=zero, schedule=plan.schedule)
        if plan.num_stages > 1 and _runner_kind(plan) != "torch_pipeline":
            raise PlanError(_CP_P2P.format(cp=cps[0].cp), _CP_P2P_FIX)


_CP_P2P = (
    "context parallelism (cp={cp}) in a pipeline that runs on explicit send/recv (stages of different shapes, "
    "ZeRO-2/3 or a schedule beyond GPipe / 1F1B) is not built by the PyTorch program: it hands each rank's "
    "S / cp tokens on through torch.distributed.pipelining only, between ranks of the same (dp, cp, tp) coordinate."
)
_CP_P2P_FIX = "compile with equal stages, ZeRO-0/1 and --schedule 1f1b or gpipe, or without --cp."


def check_cp_layout(model_spec: str, *, cp: int, tp: int, pp: int, zero: int = 0, schedule: str = "1f1b") -> None:
    """Refuse (PlanError) context parallelism where the program does not build it: with tensor parallelism (no
    tensor-parallel attention over a split sequence), in a pipeline that does not run on
    ``torch.distributed.pipelining`` (ZeRO-2/3, schedules beyond GPipe / 1F1B: :data:`_CP_P2P`), and for a
    model outside ``context_parallel.ARCHS``. ``driver.compile_layout`` calls it before tracing."""
    if cp == 1:
        return
    if tp > 1:
        raise PlanError(
            f"context parallelism (cp={cp}) with tensor parallelism (tp={tp}) is not built by the PyTorch program "
            "yet: its attention gathers keys and values over the cp ranks of a replica, not over tensor-parallel "
            "heads of a split sequence.",
            "compile with --cp and --tp 1, or without --cp; `partita evaluate --cp` prices the other layouts.",
        )
    if pp > 1 and (zero >= 2 or schedule not in ("gpipe", "1f1b")):
        raise PlanError(_CP_P2P.format(cp=cp), _CP_P2P_FIX)
    model = _meta_model(model_spec)
    arch = type(model).__name__ if model is not None else None
    from partita.backends.torch.context_parallel import ARCHS

    if arch is not None and arch not in ARCHS:
        raise PlanError(
            f"context parallelism (cp={cp}) is built for {', '.join(ARCHS)} (its attention interface and "
            f"rotary positions), and {model_spec} is a {arch}.",
            "compile this model without --cp.",
        )


def emit_torch(plan: Plan, model_spec: str) -> str:
    """The source of one Python module that trains ``plan`` for ``model_spec`` under torchrun."""
    check_schedule(plan)
    check_cp(plan, model_spec)
    f8_stages = [s for s in plan.stages if s.fp8]
    if f8_stages:  # search/pricing/fp8.py: what the program builds with fp8 (tp = 1 on the fp8 stages)
        from partita.search.pricing import fp8 as fp8_pricing

        fp8_pricing.check_recipe(str(f8_stages[0].fp8))
        fp8_pricing.check_layout(max(s.tp for s in f8_stages))
    kind = _runner_kind(plan)
    chunked, plan = plan, vchunks.physical_plan(plan)  # chunks of a rank group: one setup_stage (chunks.py)
    # tp roles: a searched plan's own (Stage.tp_plan, written literally; the runtime checks them against
    # the module tree it builds, tp.module_roles); derived on the model built on meta for a tp stage
    # without them (hand-placed plans), the only case that imports torch and the model's code here
    needs_model = any(s.tp > 1 and not s.tp_plan for s in plan.stages)
    facts = stage_facts(plan, _meta_model(model_spec) if needs_model else None)
    prog = _program(plan, model_spec, facts)
    if chunked.chunked:
        prog["runner"], prog["chunks"] = kind, vchunks.chunk_table(chunked)
        prog["layers"] = [name for s in chunked.stages for name in s.layers]  # model order
    stage_lines = "\n".join(
        f"Stage {s.index}: ranks {list(s.ranks)}, mesh {_mesh_text(s)[0]} {s.device_type}, layers "
        f"{', '.join(s.layers)}; ZeRO-{s.zero_stage}, recompute {s.recompute}, batch shares "
        f"{list(shares(s, plan.micro_batch_size))}"
        for s in plan.stages
    )
    header = _HEADER
    if any(_precision(plan, s) == "fsdp" for s in plan.stages):
        header = header.replace(
            "from torch.distributed.fsdp import fully_shard",
            "import torch\nfrom torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
        )
    if any(s.cp > 1 for s in plan.stages):
        header = header.replace(
            "from partita.backends.torch import parallel as tpar",
            "from partita.backends.torch import context_parallel as cpr\nfrom partita.backends.torch import parallel as tpar",
        )
    if f8_stages:
        header = header.replace(
            "from partita.backends.torch import parallel as tpar",
            "from partita.backends.torch import fp8\nfrom partita.backends.torch import parallel as tpar",
        )
    if any(_precision(plan, s) in ("fsdp", "autocast") for s in plan.stages):
        header = header.replace(
            "from partita.backends.torch import parallel as tpar",
            "from partita.backends.torch import fused\nfrom partita.backends.torch import parallel as tpar",
        )
    parts = [
        header.format(
            model=model_spec,
            launch=torch_launch.run_line(plan),
            cluster=plan.cluster.get("name", "?"),
            world=plan.world_size,
            num_stages=plan.num_stages,
            schedule=plan.schedule,
            graph=plan.model.get("graph_hash", "?"),
            fingerprint=plan.cluster.get("fingerprint", "?"),
            stage_lines="\n".join([stage_lines, *vchunks.placement_lines(chunked)]),
            global_batch=plan.training.get("global_batch"),
            num_micro=plan.num_micro_batches,
            mb_total=sum(shares(plan.stages[0], plan.micro_batch_size)),
            seq=plan.training.get("seq_len"),
            optimizer=plan.training.get("optimizer", "adamw"),
        ),
        "PROGRAM = " + pprint.pformat(prog, width=110, sort_dicts=True),
        'PROGRAM["__file__"] = __file__',
        *(_setup_stage(plan, s, f) for s, f in zip(plan.stages, facts)),
        "SETUP_STAGE = [" + ", ".join(f"setup_stage_{s.index}" for s in plan.stages) + "]",
        _make_runner(chunked, kind),
        "def lr_lambda(step):\n    return 1.0  # constant learning rate; edit for warmup / decay",
        'if __name__ == "__main__":\n    torch_train.main(PROGRAM, SETUP_STAGE, make_runner, lr_lambda)',
    ]
    return "\n\n\n".join(parts) + "\n"
