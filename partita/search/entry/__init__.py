"""The search's entry points: what ``partita compile`` / ``evaluate`` and the benches call.

Owns ``planner.plan_graph`` (the outer loop over configurations and schedules), ``evaluate`` of a
hand-written Megatron layout, the Plan of a hand layout (``hand_plan``) and the best hand layout the
report compares with (``hand_best``), the one pricing of a hand layout they all share (``layout_price``), the baselines (``baselines``), the no-plan proofs and messages
(``infeasible``) and the forked workers beside the search (``prefetch``). The top room: it may import
every other room of ``partita.search``; nothing in ``partita.search`` imports it.
"""
