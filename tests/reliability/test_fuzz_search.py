"""Fuzzing the search: random IR graphs on random clusters give a valid plan that fits, or a clear
infeasible error, never a crash (property in ``random_graphs.check_search``).

The CI budget is ``PARTITA_FUZZ_EXAMPLES`` examples (default 40, about 10 s here); ``bench/fuzz.py``
runs the same property with a larger budget and records the outcome counts.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partita.cluster import cluster_from_dict
from tests.reliability.random_graphs import (
    GraphSpec,
    build,
    check_search,
    cluster_dicts,
    graph_specs,
    search_options,
    trainings,
)

EXAMPLES = int(os.environ.get("PARTITA_FUZZ_EXAMPLES", "40"))
OUTCOMES: dict[str, int] = {}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(graph_specs, cluster_dicts, trainings, search_options)
def test_search_gives_valid_plan_or_infeasible(spec: GraphSpec, cluster: dict, training, options) -> None:
    outcome = check_search(build(spec), cluster_from_dict(cluster, "fuzz cluster"), training, options)
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1


def test_fuzz_reached_both_outcomes() -> None:
    """The generators are not degenerate: across the run both a plan and an infeasible error occurred."""
    if EXAMPLES < 20 or not OUTCOMES:
        pytest.skip("needs test_search_gives_valid_plan_or_infeasible to run first with >= 20 examples")
    assert OUTCOMES.get("plan", 0) > 0 and OUTCOMES.get("infeasible", 0) > 0, OUTCOMES


@settings(max_examples=min(EXAMPLES, 25), deadline=None, derandomize=True)
@given(graph_specs)
def test_random_graphs_verify_and_repeat(spec: GraphSpec) -> None:
    """Each random graph verifies, and its identical blocks share one layer kind (solved once)."""
    g = build(spec)
    g.verify()
    assert g.layers[0].name == "embed" and g.layers[-1].name == "head"
    if spec.num_blocks >= 2:
        blocks = [lay for lay in g.layers if lay.name.startswith("blocks.")]
        assert len(blocks) == spec.num_blocks and len({lay.kind for lay in blocks}) == 1


@settings(max_examples=min(EXAMPLES, 15), deadline=None, derandomize=True)
@given(st.sampled_from(["4xCPU", "8xA100-80G", "2xA100-80G+2xV100-32G"]), graph_specs)
def test_shorthand_clusters(cluster: str, spec: GraphSpec) -> None:
    from partita.cluster import parse_cluster
    from partita.search.pricing.config import SearchOptions, TrainingConfig

    check_search(build(spec), parse_cluster(cluster), TrainingConfig(global_batch=32, seq_len=64), SearchOptions())
