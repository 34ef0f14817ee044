"""What the emitted programs can run of context parallelism and FP8: the switch the search reads (issue 36).

Design rule 1 (the search space is what the emitters produce): the planner offers a choice only where
the program of the plan's framework builds it. Two choices of issue 36 are priced before every emitter
builds them, so the search asks here:

* **cp** (context parallelism, ``search/pricing/context_parallel.py``): :data:`CP_EMITTED` says, per
  framework, whether its emitter writes a plan's ``Stage.cp`` (the sequence split over the cp axis,
  K/V all-gathered for attention). The torch program does, for what ``backends/torch/emit.check_cp_layout``
  accepts: Llama models (:data:`CP_ARCHS`), tp 1 (:data:`CP_MAX_TP`), and a pipeline only on
  ``torch.distributed.pipelining`` (equal stages, ZeRO-0/1, GPipe / 1F1B: :func:`cp_plan_refusal`); the
  JAX program does not. The search offers cp only there: each cp search runs at tp 1, and a cp plan the
  program would refuse is searched again at ZeRO-0/1 with 1F1B, else left out with the reason.
  Where cp is offered, :func:`cp_degrees` gives the degrees: powers of two from 2 whose ranks keep at
  least :data:`MIN_LOCAL_SEQ` tokens each (Llama 3 trains at 131,072 tokens with cp 16: 8,192 per rank).
  Below that the search's time, not the price, is the reason: each degree is a search of its own
  (its layers solved at ``S / cp``), so short sequences (2,048 tokens, the search-speed targets of
  ``bench/search_speed.py``) cost nothing more, and long ones are searched at every degree the
  price then decides between. A caller that names degrees (``SearchOptions.cp_degrees``) gets those
  searched whatever this switch says (tests; ``bench/``).
* **fp8** (``search/pricing/fp8.py``): the torch program converts linears with torchao
  (``backends/torch/fp8.py``) in the stages whose ``Stage.fp8`` says so, all replicas of a stage alike,
  and only where tp = 1 (:data:`FP8_MAX_TP`); the JAX program has no FP8 training. :func:`fp8_refusal`
  says why fp8 is not offered, or None; :func:`fp8_max_tp` and :func:`fp8_mix_ok` keep an fp8 search
  to that (tp 1 on the FP8 types, no mixed-replica stage of FP8 and bf16 types).

Pure data and functions: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from partita.cluster import DeviceType
from partita.plan import Plan

# per framework: does its emitter build Stage.cp? (backends/torch/emit.check_cp / context_parallel.refuse_emit)
CP_EMITTED: dict[str, bool] = {"torch": True, "jax": False}
CP_ARCHS = ("LlamaForCausalLM",)  # backends/torch/context_parallel.ARCHS (a test checks they agree)
CP_MAX_TP = 1  # the torch program's cp attention gathers K/V over a replica's cp ranks, not tp heads
MIN_LOCAL_SEQ = 8192  # tokens per rank below which the default search offers no cp (module docstring)
MAX_CP = 16  # Llama 3's largest (405B at 131,072 tokens)

FP8_EMITTED: dict[str, bool] = {"torch": True, "jax": False}  # backends/torch/fp8.py; JAX refuses fp8 plans
FP8_MAX_TP = 1  # the torch program does not emit torchao's Float8ColwiseParallel / Float8RowwiseParallel


def cp_emitted(framework: str) -> bool:
    return CP_EMITTED.get(framework, False)


def cp_degrees(framework: str, seq_len: int, model_class: str | None = None) -> tuple[int, ...]:
    """The cp degrees > 1 the default search offers for ``framework`` at ``seq_len`` (module docstring);
    ``model_class`` (the graph's ``meta["model_class"]``, None: not known) outside :data:`CP_ARCHS`: none."""
    if not cp_emitted(framework) or (model_class is not None and model_class not in CP_ARCHS):
        return ()
    out, c = [], 2
    while c <= MAX_CP and seq_len % c == 0 and seq_len // c >= MIN_LOCAL_SEQ:
        out.append(c)
        c *= 2
    return tuple(out)


def cp_refusal(framework: str, seq_len: int, model_class: str | None = None) -> str | None:
    """Why the default search offers no cp (None where it offers some)."""
    if not cp_emitted(framework):
        return (
            f"cp not offered: the {framework} program does not split the sequence (compile --cp is "
            "refused there); `partita evaluate --cp` prices it"
        )
    if model_class is not None and model_class not in CP_ARCHS:
        return (
            f"cp not offered: the {framework} program builds context parallelism for {', '.join(CP_ARCHS)} "
            f"(its attention and rotary positions), not {model_class}; `partita evaluate --cp` prices it"
        )
    if not cp_degrees(framework, seq_len):
        return f"cp not offered: {seq_len:,} tokens, fewer than {2 * MIN_LOCAL_SEQ:,} (cp 2 keeps {MIN_LOCAL_SEQ:,} per rank)"
    return None


def cp_plan_refusal(plan: Plan) -> str | None:
    """Why the torch program would refuse this cp plan (``backends/torch/emit.check_cp``), or None."""
    from partita.search.program import records

    cp = max(s.cp for s in plan.stages)
    if cp == 1:
        return None
    tp = max(s.tp for s in plan.stages)
    if tp > CP_MAX_TP:
        return f"cp {cp} with tp {tp}: the program builds cp at tp 1 only"
    if plan.num_stages > 1 and records.runner_kind(plan) != "torch_pipeline":
        return (
            f"cp {cp} in a pipeline on explicit send/recv (schedule {plan.schedule}, ZeRO-2/3 or stages of "
            "different shapes): the program pipelines cp on torch.distributed.pipelining only"
        )
    return None


def fp8_types(types: Iterable[DeviceType]) -> list[DeviceType]:
    """The device types with FP8 tensor cores (``fp8.peak`` > 0; CPU ranks run torchao's emulation)."""
    from partita.search.pricing import fp8

    return [d for d in types if fp8.peak(d) > 0]


def fp8_refusal(framework: str, types: Iterable[DeviceType]) -> str | None:
    """Why the search offers no fp8 plan at all (None where it offers one)."""
    if not FP8_EMITTED.get(framework, False):
        return f"fp8 not offered: the {framework} program has no FP8 training"
    if not fp8_types(types):
        names = ", ".join(d.name for d in types)
        return f"fp8 not offered: {names} {'has' if ',' not in names else 'have'} no FP8 tensor cores"
    return None


def fp8_max_tp(training: Any, dev: DeviceType, top: int) -> int:
    """The largest tp (at most ``top``) the search offers ``dev``: :data:`FP8_MAX_TP` on an FP8 type when
    fp8 is allowed (its stages train in fp8), ``top`` otherwise (a type without FP8 keeps bf16 at any tp)."""
    from partita.search.pricing import fp8

    return min(top, FP8_MAX_TP) if getattr(training, "fp8", None) and fp8.peak(dev) > 0 else top


def fp8_mix_ok(training: Any, types: Iterable[DeviceType]) -> bool:
    """Can one stage have replicas of all ``types``? Not FP8 and bf16 types together when fp8 is allowed:
    the program converts a stage's replicas all or none (``Stage.fp8``)."""
    from partita.search.pricing import fp8

    return not getattr(training, "fp8", None) or len({fp8.peak(d) > 0 for d in types}) == 1
