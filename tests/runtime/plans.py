"""Hand-made Plans for the runtime tests: the layouts the brief lists, for the zoo's tiny models.

The plans are test inputs (the search is not involved). Each layout's expected collectives are
derived from the layout here, from first principles, and written into ``Stage.collectives``
where the count is a function of the layout alone (DP all-reduce per parameter, pipeline p2p).
"""

from __future__ import annotations

from partita.cluster import parse_shorthand
from partita.plan import Collective, Plan, Stage

LAYERS = {
    "gpt2-tiny": ["embed", "transformer.h.0", "transformer.h.1", "head"],
    "llama-tiny": ["embed", "model.layers.0", "model.layers.1", "head"],
    "mlp": ["fc1", "act", "fc2"],
}
# Parameter counts per layer group (distinct tensors), for the data-parallel all-reduce counts.
NUM_PARAMS = {
    "gpt2-tiny": {"embed": 2, "block": 12, "head": 2},  # head: ln_f.{weight,bias}; lm_head is tied to wte
    "llama-tiny": {"embed": 1, "block": 9, "head": 2},  # head: norm.weight + lm_head.weight (untied)
    "mlp": {"fc1": 2, "act": 0, "fc2": 2},
}


def tp_placements(model: str, layers: list[str]) -> dict[str, tuple[str, str]]:
    """Megatron-style column/row placements on the tp axis for the stage's layers (dp axis R)."""
    out: dict[str, str] = {}
    for name in layers:
        if model == "gpt2-tiny" and name.startswith("transformer.h."):
            # transformers' Conv1D keeps weight as [in, out]: column-parallel = S(1), row-parallel = S(0)
            out |= {f"{name}.attn.c_attn.weight": "S(1)", f"{name}.attn.c_attn.bias": "S(0)"}
            out |= {f"{name}.attn.c_proj.weight": "S(0)", f"{name}.mlp.c_fc.weight": "S(1)"}
            out |= {f"{name}.mlp.c_fc.bias": "S(0)", f"{name}.mlp.c_proj.weight": "S(0)"}
        elif model == "gpt2-tiny" and name == "embed":
            out["transformer.wte.weight"] = "S(0)"  # vocab-parallel embedding (tied with lm_head)
        elif model == "llama-tiny" and name.startswith("model.layers."):
            for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                out[f"{name}.{p}.weight"] = "S(0)"
            out |= {f"{name}.self_attn.o_proj.weight": "S(1)", f"{name}.mlp.down_proj.weight": "S(1)"}
        elif model == "llama-tiny" and name == "head":
            out["lm_head.weight"] = "S(0)"
        elif model == "mlp" and name == "fc1":
            out |= {"fc1.weight": "S(0)", "fc1.bias": "S(0)"}
        elif model == "mlp" and name == "fc2":
            out["fc2.weight"] = "S(1)"
    return {k: ("R", v) for k, v in out.items()}


def num_params(model: str, layers: list[str]) -> int:
    n = NUM_PARAMS[model]
    return sum(n.get(x, n.get("block", 0)) for x in layers)


def make_plan(
    model: str,
    stages: list[dict],
    *,
    schedule: str = "1f1b",
    micro_batch_size: int = 2,
    num_micro_batches: int = 2,
    global_batch: int = 8,
    seq_len: int = 16,
    optimizer: str = "adamw",
) -> Plan:
    """``stages``: dicts with layers, ranks, dp, tp and optional zero_stage, recompute, batch_shares."""
    world = sum(len(s["ranks"]) for s in stages)
    cluster = parse_shorthand(f"{world}xCPU")
    out = []
    for i, s in enumerate(stages):
        placements = tp_placements(model, s["layers"]) if s["tp"] > 1 else {}
        colls = []
        if s["dp"] > 1 and s.get("zero_stage", 0) == 0:  # one SUM all-reduce per gradient tensor
            colls.append(Collective("all_reduce", "dp", 0.0, num_params(model, s["layers"]), "backward", "grad sync"))
        out.append(
            Stage(
                index=i,
                layers=tuple(s["layers"]),
                device_type="CPU",
                ranks=tuple(s["ranks"]),
                dp=s["dp"],
                tp=s["tp"],
                zero_stage=s.get("zero_stage", 0),
                recompute=s.get("recompute", "none"),
                batch_shares=tuple(s.get("batch_shares", ())),
                param_placements=placements,
                collectives=tuple(colls),
            )
        )
    return Plan(
        model={"name": model, "framework": "torch", "layers": LAYERS[model]},
        cluster={"name": cluster.name, "fingerprint": cluster.fingerprint(), "spec": cluster.to_dict()},
        training={"global_batch": global_batch, "seq_len": seq_len, "dtype": "f32", "optimizer": optimizer, "lr": 0.01},
        stages=tuple(out),
        schedule=schedule,
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches,
        predicted={"step_time_s": 0.05},
        partita_version="0.1.0",
    )


def layout(model: str, name: str) -> Plan:
    """The named test layout for ``model`` (layer lists split in the middle for two stages)."""
    L = LAYERS[model]
    a, b = L[: len(L) // 2], L[len(L) // 2 :]
    one = lambda **kw: [dict(layers=L, **kw)]  # noqa: E731
    table = {
        "dp": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1)),
        "tp": lambda: make_plan(model, one(ranks=[0, 1], dp=1, tp=2), micro_batch_size=4),
        "dp_tp": lambda: make_plan(model, one(ranks=[0, 1, 2, 3], dp=2, tp=2)),
        "zero3": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1, zero_stage=3, recompute="full")),
        "uneven": lambda: make_plan(model, one(ranks=[0, 1], dp=2, tp=1, batch_shares=(3, 1))),
        "pp_1f1b": lambda: make_plan(
            model, [dict(layers=a, ranks=[0], dp=1, tp=1), dict(layers=b, ranks=[1], dp=1, tp=1)],
            micro_batch_size=2, num_micro_batches=4,
        ),
        "pp_gpipe": lambda: make_plan(
            model, [dict(layers=a, ranks=[0], dp=1, tp=1), dict(layers=b, ranks=[1], dp=1, tp=1)],
            schedule="gpipe", micro_batch_size=2, num_micro_batches=4,
        ),
        "pp_tp": lambda: make_plan(
            model, [dict(layers=a, ranks=[0, 1], dp=1, tp=2), dict(layers=b, ranks=[2, 3], dp=1, tp=2)],
            micro_batch_size=4, num_micro_batches=2,
        ),
        "hetero": lambda: make_plan(
            model, [dict(layers=a, ranks=[0, 1], dp=1, tp=2), dict(layers=b, ranks=[2], dp=1, tp=1)],
            micro_batch_size=4, num_micro_batches=2,
        ),
    }  # fmt: skip
    return table[name]()
