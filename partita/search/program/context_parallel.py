"""The Plan's collective records of context parallelism (issue 36): what a stage with ``cp > 1`` issues per step.

The scheme is the one ``search/pricing/context_parallel.py`` prices and ``backends/torch/context_parallel.py``
runs (all-gather K/V). Per step, on the stage's first rank, with ``m`` micro-batches:

* per attention of the stage's layers, forward: one all-gather of K and one of V over the ``cp`` axis,
  ``m`` times, bytes of the whole sequence's K (V) of this rank's tp share of the key/value heads
  (:func:`~partita.search.pricing.context_parallel.gathered_kv`, the function the pricing sums);
  backward: one reduce-scatter of dK and one of dV, same bytes, ``m`` times. Under full recompute
  the forward all-gathers run again in the backward (``torch.utils.checkpoint`` re-runs the block);
* parameters are replicated over ``cp`` as over ``dp``, so what ``search/program/records.py`` records
  over ``dp`` (the gradient all-reduce, ZeRO's all-gathers and reduce-scatters) runs over the
  ``dp * cp`` ranks of the stage: those records are computed as for a stage of ``dp * cp`` replicas
  and carry the flattened axis :data:`REPLICA_AXIS` (torchtitan's ``dp_shard_cp``). Pipeline transfers
  are each rank's own ``S / cp`` tokens to the rank of the same (dp, cp) coordinate: those records are
  computed for that view too, ``dp * cp`` replicas of ``S / cp`` tokens (``context_parallel.local_training``'s).

Selective recompute with cp > 1 is refused: whether its checkpoint policy saves the K/V all-gathers
(and so how many the program issues) is not established. ``search/entry/hand_plan.py`` (``cp=``, from
``partita compile --cp``) and the search (``search/entry/choices.py``, where ``search/program/realizable.py``
offers cp) write ``cp > 1`` (both through ``search/program/cp_layout.with_cp``); the PyTorch program builds
the scheme (``backends/torch/emit.py``) and counts its collectives against these records (``partita run``,
``rehearse``). ``complete`` starts
from the ILP's per-micro-batch records in ``Stage.collectives``, as ``records.complete`` does. Pure functions over the Plan and the IR: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from partita.errors import ConfigError, PlanError
from partita.ir import Graph
from partita.plan import Collective, Plan, Stage, shares
from partita.search.pricing import context_parallel as cpx
from partita.search.program import records

CP_AXIS = "cp"
REPLICA_AXIS = "dp_cp"  # dp and cp flattened: the ranks a parameter is replicated over


def check(plan: Plan) -> None:
    """Refuse (ConfigError) a plan whose cp stages these records cannot describe (module docstring)."""
    bad = [s.index for s in plan.stages if s.cp > 1 and s.recompute == "selective"]
    if bad:
        raise ConfigError(
            f"stage(s) {bad} combine context parallelism (cp > 1) with selective recompute, whose checkpoint "
            "policy may or may not re-run the K/V all-gathers: the collectives the program issues are not known.",
            "use recompute none or full with cp > 1.",
        )


def attention_records(graph: Graph, plan: Plan, i: int) -> tuple[Collective, ...]:
    """The cp axis' all-gathers and reduce-scatters of stage ``i`` per step (module docstring); none when cp = 1."""
    s = plan.stages[i]
    if s.cp == 1:
        return ()
    m, seq = plan.num_micro_batches, int(plan.training["seq_len"])
    dtype = str(plan.training.get("dtype", "f32"))
    micro_batch = shares(s, plan.micro_batch_size)[0]  # the stage's first rank is in replica 0
    layers = {lay.name: lay for lay in graph.layers}
    out: list[Collective] = []
    for name in s.layers:
        for n in cpx.attention_nodes(graph, layers[name]):
            kv = cpx.gathered_kv(
                graph, n, cp=s.cp, tp=s.tp, micro_batch=micro_batch, local_seq=seq // s.cp, dtype=dtype
            )
            for what, nbytes in zip(("keys", "values"), kv):
                why = f"context parallel {name} {n.name}: {what}"
                out.append(Collective("all_gather", CP_AXIS, nbytes, m, "forward", why))
                if s.recompute == "full":
                    out.append(Collective("all_gather", CP_AXIS, nbytes, m, "forward", "recomputed: " + why))
                out.append(Collective("reduce_scatter", CP_AXIS, nbytes, m, "backward", why + " (gradient)"))
    return tuple(out)


def _as_replicas(s: Stage) -> Stage:
    """``s`` seen by ``records.py``: ``dp * cp`` data-parallel replicas (its parameters' replication)."""
    return dataclasses.replace(s, dp=s.dp * s.cp, cp=1, batch_shares=tuple(shares_of(s)) if s.batch_shares else ())


def shares_of(s: Stage) -> Sequence[int]:
    """Per ``dp * cp`` replica, samples per micro-batch: each cp rank of a replica holds all its samples."""
    return [b for b in s.batch_shares for _ in range(s.cp)]


def complete(plan: Plan, graph: Graph, batch_scale: float = 1.0) -> Plan:
    """``plan`` with every stage's records completed: ``records.complete``'s, with the ``dp`` records of a
    cp stage over :data:`REPLICA_AXIS`, plus :func:`attention_records`."""
    check(plan)
    if all(s.cp == 1 for s in plan.stages):
        return records.complete(plan, graph, batch_scale)
    cp = plan.stages[0].cp  # one degree for the whole pipeline (plan.validate)
    training = {**plan.training, "seq_len": int(plan.training["seq_len"]) // cp}
    training["global_batch"] = int(plan.training["global_batch"]) * cp
    flat = dataclasses.replace(plan, training=training, stages=tuple(_as_replicas(s) for s in plan.stages))
    done = records.complete(flat, graph, batch_scale)
    stages = []
    for i, (s, d) in enumerate(zip(plan.stages, done.stages)):
        got = d.collectives
        if s.cp > 1:
            got = tuple(dataclasses.replace(c, axis=REPLICA_AXIS) if c.axis == "dp" else c for c in got)
        stages.append(dataclasses.replace(s, collectives=got + attention_records(graph, plan, i)))
    return dataclasses.replace(plan, stages=tuple(stages))


def refuse_emit(plan: Plan, backend: str) -> None:
    """Refuse (PlanError) to emit a plan with ``cp > 1`` for ``backend`` (the JAX emitter: it builds no cp mesh
    axis and sequence split, and a program without them would train a different model step than the plan's).
    The PyTorch emitter builds cp (``backends/torch/emit.check_cp`` says for which layouts)."""
    cps = sorted({s.cp for s in plan.stages if s.cp > 1})
    if cps:
        raise PlanError(
            f"this plan splits the sequence over cp={cps[0]} ranks (context parallelism), which the {backend} "
            "emitter does not build: the program would not shard the sequence or gather keys and values, "
            "and would not train the step the plan describes.",
            "recompile the plan without context parallelism (cp 1), or use a PyTorch model, whose program builds it.",
        )
