"""Training and search configuration: the frozen inputs of :func:`partita.search.entry.planner.plan_graph`.

``TrainingConfig`` is what the user trains (batch, sequence, dtype, optimizer); ``SearchOptions``
says how widely the inter-operator DP looks. Both are frozen keyword dataclasses so a plan is a pure
function of (graph, cluster, training, options) and the compile cache can key on them.
"""

from __future__ import annotations

import dataclasses

from partita.errors import ConfigError
from partita.ir import DTYPE_BYTES
from partita.plan import RECOMPUTE, SCHEDULES

OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    global_batch: int
    seq_len: int
    dtype: str = "bf16"
    fp8: str | None = None  # a torchao float8 recipe (search/pricing/fp8.py): linears' GEMMs in FP8, dtype bf16
    optimizer: str = "adam"
    # carried into plan.training and the program (backends/torch/optim.py); None: the runtime default
    lr: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    lr_decay: str | None = None  # "constant" | "cosine"
    min_lr: float | None = None
    grad_clip: float | None = None  # global L2 norm; its all-reduce is recorded in every stage
    steps: int | None = None
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise ConfigError(
                f"global_batch={self.global_batch} and seq_len={self.seq_len} must be >= 1.",
                "pass positive integers.",
            )
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r} is unknown.", "use bf16, f16 or f32.")
        if self.fp8 is not None:
            from partita.search.pricing.fp8 import check_recipe

            check_recipe(self.fp8)
            if self.dtype != "bf16":
                raise ConfigError(
                    f"fp8 training with dtype {self.dtype!r}: FP8 linears compute around bf16 (torchao).",
                    "use dtype bf16 with fp8 (--precision fp8 sets it).",
                )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer {self.optimizer!r} is unknown.", f"use one of {OPTIMIZERS}.")

    def to_dict(self) -> dict[str, object]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """Knobs of the inter-operator search; the defaults are what ``partita compile`` uses.

    * ``schedules``: pipeline schedules to consider. GPipe is off by default because under this cost
      model it is never faster than 1F1B (the simulated schedules) and never holds less memory (pruning
      rule R4 in ``inter_op``).
      ``interleaved_1f1b`` (issue 19) is on by default for torch models: the planner refines its best
      multi-stage plans with ``v`` in ``virtual_stages`` chunks per rank group, priced by simulating the
      interleaved action list on each rank group's F/B/W split over its chunks, and keeps only the
      candidates the torch program runs as model chunks (``search/chunk_layout.runnable``: loop
      placement keeps every rank group's layer kinds, one device type per group, no ZeRO-2/3 over
      dp > 1, which would sync per backward while the rank's other chunks accumulate); the winner is laid
      out as one Stage per virtual stage (``chunk_layout.lay_out``, ``plan.py``) and
      ``backends/torch/schedule.P2PPipeline`` runs it. JAX models leave it out: the JAX program runs a
      chunked plan (``backends/jax/parallel.pipeline_schedule``; hand-made plans,
      ``tests/runtime_jax``), but ``chunk_layout.lay_out`` completes a chunked plan's records the torch
      program's way (``search/program/records.py``), and a JAX plan's per-chunk records are not built, so
      ``emit_jax`` refuses an interleaved plan that is not laid out in chunks (issue 15, item 5). ``zb_h1`` (issue 19: 1F1B with the weight gradients W deferred into the
      cool-down bubble, priced by simulating its action list, ``search/pipeline/pipeline_sim.py``) is on by
      default: the torch program runs it (``backends/torch/schedule.P2PPipeline``) on stages with ZeRO-0
      or ZeRO-1 and no recompute, the only ones the planner searches under it; JAX models leave it out (no JAX
      runtime splits the backward). ``zbv`` (ZB-V, two chunks per rank group in a V) is priced on
      the layout the runtime runs (``search/program/v_layout.py``: from the best ZB-H1 candidates, the model
      cut into ``2p`` chunks, chunk ``s`` on rank group ``s`` or ``2p - 1 - s``, each chunk's F/B/W and
      each group's memory from its own layers) and the winner is the chunked plan ``P2PPipeline`` runs
      (a searched plan matches the single-device run on gloo, ``tests/runtime/test_schedules_runtime.py``,
      and ``partita rehearse`` matches its plan, ``tests/runtime/test_rehearse_schedules.py``). On by default:
      it costs the search a few ZB-V layouts per best ZB-H1 candidate, and where it loses the report
      says by how much (``bench/schedules.py``).
    * ``zero_stages`` / ``recompute``: per-stage options searched. ``"selective"`` is priced from what
      the runtime recomputes (``search/stage_cost.SolverCosts._selective``): a torch block keeps its
      input and the outputs of its matmuls and tp collectives and runs every other op's forward again
      in the backward (``backends/torch/parallel._save_matmuls``); ``embed`` / ``head`` are never
      checkpointed; the JAX program checkpoints whole layers, so there it is priced as ``"full"``.
    * ``max_tp``: largest tensor-parallel degree (also capped by devices per node, rule R1).
    * ``max_micro_batch``: largest per-replica micro-batch tried.
    * ``max_layer_units``: stage boundaries fall between groups of consecutive layers so that the model
      has at most this many units (rule R2); 0 = every layer boundary.
    * ``t_max_epsilon``: relative thinning of the t_max enumeration (rule R2, ``inter_op``); 0 = exact.
    * ``tail_epsilon``: relative step of the tail caps (rule R7, ``planner``); 0 = exact.
    * ``uneven_shares``: allow stages whose replicas run on different device types (Cephalo).
    * ``num_alternatives``: how many runner-up plans to report.
    * ``cp_degrees``: context-parallel degrees (> 1) searched beside cp 1 (issue 36), each a search of
      its own with the layers at ``S / cp`` (``search/pipeline/cp_costs.py``); the fastest plan of all
      wins and the report says why. None: what the emitter of the graph's framework builds
      (``search/program/realizable.cp_degrees``: none today; powers of two keeping >= 8,192 tokens per
      rank once it does); ``()``: cp 1 only.
    * ``p2p_overlap``: stage-to-stage sends and receives run beside the compute, so a stage's micro-batch
      costs ``max(compute + collectives, p2p)`` instead of their sum (``stage_ranges.stage_parts``): what
      Megatron-LM's interleaved schedule runs with ``--overlap-p2p-comm`` and Llama 3's asynchronous p2p
      (arXiv:2407.21783, sec. 3.3.2). Only ``evaluate_config(tp_style="megatron", p2p_overlap=True)`` sets
      it, pricing another stack's program (``bench/published.py``); Partita's programs and the search
      keep it off.
    * ``allow_f16``: train a bf16 request in fp16 (with dynamic loss scaling) when the cluster has GPUs
      without bf16 tensor cores (V100, T4) and none loses by it (``search/pricing/precision.py``).
    """

    schedules: tuple[str, ...] = ("1f1b", "zb_h1", "interleaved_1f1b", "zbv")  # docstring: what the runtimes run
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    max_tp: int = 8
    max_micro_batch: int = 32
    max_layer_units: int = 32
    t_max_epsilon: float = 0.002
    tail_epsilon: float = 0.01
    uneven_shares: bool = True
    virtual_stages: tuple[int, ...] = (2, 4)
    num_alternatives: int = 5
    cp_degrees: tuple[int, ...] | None = None  # None: search/program/realizable.cp_degrees
    allow_f16: bool = True  # the torch runtime scales the loss dynamically (backends/torch/optim.LossScaler)
    record_time: bool = False  # put the search wall time in plan.search (breaks byte-identical plans)
    p2p_overlap: bool = False  # another stack's overlapped p2p (docstring); never a Partita program's

    def __post_init__(self) -> None:
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ConfigError(f"schedules {bad or '()'} are unknown.", f"use some of {SCHEDULES}.")
        if any(z not in (0, 1, 2, 3) for z in self.zero_stages) or not self.zero_stages:
            raise ConfigError(f"zero_stages {self.zero_stages} must be a non-empty subset of 0..3.", "e.g. (0, 1).")
        if any(r not in RECOMPUTE for r in self.recompute) or not self.recompute:
            raise ConfigError(f"recompute {self.recompute} must be a non-empty subset of {RECOMPUTE}.", "")
        if self.cp_degrees is not None and any(c < 2 for c in self.cp_degrees):
            raise ConfigError(f"cp_degrees {self.cp_degrees} must be > 1 (cp 1 is always searched).", "e.g. (2, 4).")
        if self.max_tp < 1 or self.max_micro_batch < 1 or self.t_max_epsilon < 0 or not 0 <= self.tail_epsilon < 1:
            raise ConfigError(
                "max_tp and max_micro_batch must be >= 1, t_max_epsilon >= 0 and 0 <= tail_epsilon < 1.",
                "fix the option.",
            )


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``: the dp, tp and micro-batch sizes the search tries."""
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out
