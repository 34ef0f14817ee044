"""Fuzzing the cluster-spec and plan parsers: any input gives a value or a PartitaError, never a crash."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partita.cluster import cluster_from_dict, parse_shorthand
from partita.errors import PartitaError, PlanError
from partita.plan import Plan
from tests.test_plan import make_plan

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10_000), st.floats(allow_nan=True), st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=12,
)
device_names = st.sampled_from(["A100-80G", "V100-32G", "L4", "H100", "CPU", "B200", "", "x"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=40))
def test_shorthand_never_crashes(spec: str) -> None:
    try:
        c = parse_shorthand(spec)
    except PartitaError:
        return
    assert c.num_devices > 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 40), device_names), min_size=1, max_size=3))
def test_structured_shorthand(terms: list[tuple[int, str]]) -> None:
    spec = "+".join(f"{n}x{d}" for n, d in terms)
    try:
        c = parse_shorthand(spec)
    except PartitaError as e:
        assert "Fix:" in str(e)
        return
    assert c.num_devices == sum(n for n, _ in terms)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "name": json_scalars,
            "network": st.one_of(
                json_values, st.fixed_dictionaries({}, optional={"nic_gbps": json_scalars, "latency_us": json_scalars})
            ),
            "nodes": st.one_of(
                json_values,
                st.lists(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "device": st.one_of(device_names, json_scalars),
                            "num_nodes": json_scalars,
                            "gpus_per_node": json_scalars,
                            "intra_node_GBps": json_scalars,
                        },
                    ),
                    max_size=3,
                ),
            ),
            "device_types": json_values,
        },
    )
)
def test_cluster_dict_never_crashes(d: dict) -> None:
    try:
        c = cluster_from_dict(d)
    except PartitaError:
        return
    assert c.num_devices > 0 and c.network.nic_bandwidth > 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_plan_parser_never_crashes(data: st.DataObject) -> None:
    """Mutate one field of a valid plan (or truncate it) and parse it again."""
    d = json.loads(make_plan().to_json())
    path = data.draw(
        st.sampled_from(
            [
                ("schedule",),
                ("micro_batch_size",),
                ("stages", 0, "dp"),
                ("stages", 1, "ranks"),
                ("stages", 0, "layers"),
                ("version",),
                ("model",),
                ("stages",),
                ("stages", 1, "batch_shares"),
                ("stages", 0, "collectives"),
            ]
        )
    )
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(json_values)
    text = json.dumps(d)
    if data.draw(st.booleans()):
        text = text[: data.draw(st.integers(0, len(text)))]
    try:
        plan = Plan.from_json(text)
    except PartitaError:
        return
    assert plan.world_size == sum(s.dp * s.tp for s in plan.stages)


def test_infinite_counts_are_a_plan_error() -> None:
    """JSON's ``Infinity`` where an int belongs (``int(inf)`` raises OverflowError): one PlanError, no
    traceback. Hypothesis drew these in a CI-like run; kept here so every run checks them."""
    for path, value in ((("micro_batch_size",), float("inf")), (("stages", 1, "ranks"), [float("inf")])):
        d = json.loads(make_plan().to_json())
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(PlanError, match="malformed field"):
            Plan.from_json(json.dumps(d))
