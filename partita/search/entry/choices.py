"""Context parallelism and FP8 as search choices (issue 36): which are searched, which plan wins, and why.

:func:`partita.search.entry.planner.plan_graph` hands its search of one configuration to :func:`choose`
(``run``: the planner at one cp degree, one precision, on some of the cluster's device types), which:

1. searches cp 1 in the precision the planner's rule gives (``search/pricing/precision.py``);
2. searches each cp degree offered (``SearchOptions.cp_degrees``, else what the emitter of the graph's
   framework builds: ``search/program/realizable.py``), each with its layers at ``S / cp``
   (``search/pipeline/cp_costs.py``); a degree that cannot run (does not divide the sequence, nothing
   fits) is left out with its reason;
3. where the user allowed FP8 (``TrainingConfig.fp8``: ``partita compile --precision fp8`` without a
   layout), searches an FP8 plan beside the bf16 one, on every device type: a stage on a type with
   FP8 tensor cores is priced in FP8 at tp 1 (the program does not emit torchao's tensor-parallel
   float8 styles), a stage on one without (an A100) in bf16 at any tp (``stage_cost.cost_model``,
   ``Search.tps``); no stage mixes the two (``Search.options_for``), and the plan says per stage which
   precision it keeps (``Stage.fp8``), so a mixed cluster keeps each type's best precision;
4. keeps the fastest plan (ties: cp 1, then bf16) and records in ``plan.search`` why
   (``"context_parallel"``, ``"fp8"``): each choice's best step, and one sentence the report prints.
   Nothing is recorded below ``2 * realizable.MIN_LOCAL_SEQ`` tokens without an fp8 request (no cp
   offered there, none asked), so those plans are byte-identical to the ones before issue 36; at longer
   sequences the plan says why cp was not offered when the emitter does not build it.

Why FP8 is opt-in and not the default on H100: FP8 changes the numerics (the program's parity against
one device holds within FP8's tolerance, ``docs/parity.md``, not bf16's), and the program needs torchao
where it runs (an optional extra, ``partita[fp8]``); a plan the search picks by default must run with the
base install and train like the single-device reference. torchtitan likewise trains in FP8 only when
asked (its ``float8`` model converter). ``--precision fp8`` with a hand layout trains every stage on an
FP8 type in FP8; without a layout it lets the search choose FP8 where it prices faster and the program runs it.

No torch; no import of the planner (it calls here).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from partita.cluster import Cluster
from partita.errors import ConfigError
from partita.ir import Graph
from partita.plan import Plan
from partita.search.pricing import context_parallel as cpx
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program import realizable

# run(training, cp=..., types=..., options=...) -> Plan: the planner's search of one choice
Run = Callable[..., Plan]


def choose(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    options: SearchOptions,
    run: Run,
    say: Callable[[str], None],
) -> Plan:
    """The fastest plan over cp 1, the cp degrees offered and FP8 where allowed (module docstring)."""
    framework = str(graph.meta.get("framework", "torch"))
    recipe = training.fp8
    base_tr = dataclasses.replace(training, fp8=None) if recipe else training
    if options.cp_degrees is None:
        model_class = graph.meta.get("model_class")
        degrees = realizable.cp_degrees(framework, training.seq_len, model_class)
        long_seq = training.seq_len >= 2 * realizable.MIN_LOCAL_SEQ
        cp_why = realizable.cp_refusal(framework, training.seq_len, model_class) if long_seq and not degrees else None
    else:
        degrees, cp_why = tuple(sorted(set(options.cp_degrees))), None
    if not degrees and not recipe and cp_why is None:
        return run(base_tr)  # nothing of issue 36 offered or asked: the plan as before
    plans: dict[str, Plan] = {}
    errors: dict[str, ConfigError] = {}
    _attempt(plans, errors, "cp 1", lambda: run(base_tr))
    for c in degrees:
        _attempt(plans, errors, f"cp {c}", functools.partial(_run_cp, graph, base_tr, c, run, options))
        if f"cp {c}" in plans:
            say(f"cp={c}: {_step(plans[f'cp {c}']):.4f} s")
    fp8_why = None
    if recipe:
        fp8_why = realizable.fp8_refusal(framework, cluster.device_types())
        if fp8_why is None:
            fp8_tr = dataclasses.replace(base_tr, dtype="bf16", fp8=recipe)  # every type: each stage its own
            _attempt(plans, errors, "fp8", lambda: run(fp8_tr))  # precision (stage_cost.cost_model, Search.tps)
            if "fp8" in plans:
                say(f"fp8 ({recipe}): {_step(plans['fp8']):.4f} s")
    if not plans:
        raise next(iter(errors.values()))  # cp 1's: the search as before
    refused = {k: str(e).splitlines()[0] for k, e in errors.items()}
    order = list(plans)  # cp 1, the cp degrees, fp8: ties go to the first
    label = min(order, key=lambda k: (round(_step(plans[k]), 12), order.index(k)))
    best = plans[label]
    extra: dict[str, Any] = {}
    if degrees or cp_why:
        extra["context_parallel"] = _cp_record(plans, refused, degrees, label, cp_why)
    if recipe:
        extra["fp8"] = _fp8_record(plans, refused, cluster, recipe, label, fp8_why)
    base = plans.get("cp 1")
    if base is not None and "best_hand_layout" in base.search and "best_hand_layout" not in best.search:
        extra["best_hand_layout"] = base.search["best_hand_layout"]  # the yardstick, priced beside cp 1
    predicted = best.predicted
    if label == "fp8" and predicted.get("idle_reasons"):  # a type the fp8 plan leaves idle: its precision too
        kept = extra["fp8"].get("bf16_types") or {}
        idle = {k: (f"{v}; {kept[k]}" if k in kept else v) for k, v in predicted["idle_reasons"].items()}
        predicted = {**predicted, "idle_reasons": idle}
    return dataclasses.replace(best, search={**best.search, **extra}, predicted=predicted)


def _attempt(plans: dict[str, Plan], errors: dict[str, ConfigError], label: str, fn: Callable[[], Plan]) -> None:
    """``plans[label] = fn()``, or its ConfigError in ``errors``."""
    try:
        plans[label] = fn()
    except ConfigError as e:
        errors[label] = e


def _run_cp(graph: Graph, training: TrainingConfig, cp: int, run: Run, options: SearchOptions) -> Plan:
    """The search at ``cp``, inside what the program builds (``realizable``): tp 1; a pipelined winner on
    explicit send/recv is searched again at ZeRO-0/1 with 1F1B (torch.distributed.pipelining's), and a
    plan still refused is left out with the reason."""
    cpx.check(graph, training, cp)  # the sequence divides, there is attention to gather for
    opts = dataclasses.replace(options, max_tp=min(options.max_tp, realizable.CP_MAX_TP))
    plan = run(training, cp=cp, options=opts)
    if realizable.cp_plan_refusal(plan) is not None:
        zeros = tuple(z for z in opts.zero_stages if z <= 1) or (0,)
        plan = run(training, cp=cp, options=dataclasses.replace(opts, zero_stages=zeros, schedules=("1f1b",)))
    why = realizable.cp_plan_refusal(plan)
    if why is not None:
        raise ConfigError(f"{why}.", "search without cp, or with a cluster where equal stages fit.")
    return plan


def _step(plan: Plan) -> float:
    return float(plan.predicted["step_time_s"])


def layout_text(plan: Plan) -> str:
    """The stages' dp x cp x tp, ZeRO and recompute, in a few words (the same on every stage: once)."""
    parts = []
    for s in plan.stages:
        mesh = f"dp {s.dp}" + (f" x cp {s.cp}" if s.cp > 1 else "") + f" x tp {s.tp}"
        text = f"{mesh}, ZeRO-{s.zero_stage}, " + (
            "no recompute" if s.recompute == "none" else f"{s.recompute} recompute"
        )
        if text not in parts:
            parts.append(text)
    return "; ".join(parts)


def _cp_record(
    plans: dict[str, Plan], refused: dict[str, str], degrees: tuple[int, ...], label: str, why_not: str | None
) -> dict[str, Any]:
    steps = {k.split()[1]: _step(p) for k, p in plans.items() if k.startswith("cp ")}
    out: dict[str, Any] = {"degrees": [1, *degrees], "steps": steps}
    no = {k.split()[1]: v for k, v in refused.items() if k.startswith("cp ")}
    if no:
        out["refused"] = no
    chosen = plans[label].stages[0].cp if label.startswith("cp ") else 1
    out["chosen"] = chosen
    if why_not is not None:
        out["why"] = why_not
        return out
    base = plans.get("cp 1")
    others = {int(k): v for k, v in steps.items() if k != "1"}
    if chosen > 1:
        mine = steps[str(chosen)]
        out["why"] = (
            f"cp {chosen}: {steps['1'] / mine:.2f}x faster than the best cp 1 plan ({layout_text(base)}: "
            f"{steps['1']:.3f} vs {mine:.3f} s per step)"
            if base is not None
            else f"cp {chosen}: no cp 1 plan fits ({no.get('1', 'nothing fits')})"
        )
    elif others:
        c, t = min(others.items(), key=lambda kv: kv[1])
        out["why"] = f"cp 1: the best cp {c} plan ({layout_text(plans[f'cp {c}'])}) is {t / steps['1']:.2f}x slower"
    else:
        out["why"] = "cp 1: no cp > 1 layout fits or runs (" + "; ".join(f"cp {k}: {v}" for k, v in no.items()) + ")"
    return out


def _fp8_record(
    plans: dict[str, Plan], refused: dict[str, str], cluster: Cluster, recipe: str, label: str, why_not: str | None
) -> dict[str, Any]:
    from partita.search.pricing import fp8

    out: dict[str, Any] = {"recipe": recipe, "chosen": label == "fp8"}
    if why_not is not None:
        out["why"] = why_not
        return out
    lacking = [d.name for d in cluster.device_types() if fp8.peak(d) <= 0]
    if lacking:
        out["bf16_types"] = {
            n: "no FP8 tensor cores: priced in bf16 in the fp8 plan, in stages of its own (none beside an FP8 type)"
            for n in lacking
        }
    if "fp8" in plans:
        out["types"] = _precision_by_type(plans["fp8"], cluster)
    bf = min((_step(p) for k, p in plans.items() if k != "fp8"), default=None)
    if "fp8" not in plans:
        out["why"] = f"fp8 not chosen: no fp8 plan (tp 1 on FP8 device types) fits or runs ({refused.get('fp8', '')})"
        return out
    f8 = _step(plans["fp8"])
    out["steps"] = {"bf16": bf, "fp8": f8}
    tp1 = "; tp 1 on its fp8 stages (no FP8 tensor parallelism emitted)"
    if label == "fp8":
        out["why"] = (
            f"fp8 ({recipe}): {bf / f8:.2f}x faster than the best bf16 plan ({bf:.3f} vs {f8:.3f} s per step){tp1}; "
            "needs torchao where it runs (partita[fp8])"
            if bf is not None
            else f"fp8 ({recipe}): no bf16 plan fits"
        )
    else:
        assert bf is not None
        out["why"] = (
            f"fp8 not chosen: the best fp8 plan ({layout_text(plans['fp8'])}) is {f8 / bf:.2f}x slower than bf16's "
            f"({f8:.3f} vs {bf:.3f} s per step){tp1}"
        )
    return out


def _precision_by_type(plan: Plan, cluster: Cluster) -> dict[str, str]:
    """Per device type of the cluster, the precision its stages keep in the fp8 plan and why (``Stage.fp8``)."""
    from partita.search.pricing import fp8

    out = {}
    for d in cluster.device_types():
        mine = [s for s in plan.stages if d.name in (s.replica_device_types or (s.device_type,))]
        peaks = f"{d.flops('bf16') / 1e12:g} TFLOP/s bf16, {fp8.peak(d) / 1e12:g} fp8"
        if not mine:
            out[d.name] = f"no stage in the fp8 plan ({peaks})"
        elif all(s.fp8 for s in mine):
            out[d.name] = f"fp8 on {len(mine)} stage(s) ({peaks})"
        else:
            lack = ": no FP8 tensor cores" if fp8.peak(d) <= 0 else ""
            out[d.name] = f"bf16 on {len(mine)} stage(s){lack} ({peaks})"
    return out
