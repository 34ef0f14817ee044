"""The search: from an annotated IR and a cluster to a priced :class:`~partita.plan.Plan`.

Five rooms, bottom to top; a room imports only its own modules and the rooms below it (and
``partita.ir`` / ``plan`` / ``cluster`` / ``errors`` / ``passes``), never one above
(``tests/test_layout.py`` checks the order):

``pricing/``   what one device type and one link cost: roofline compute, alpha-beta collectives,
               logical meshes, training precision, the frozen training and search configuration.
``layer/``     the layer problem: each op's sharding strategies, resharding between layouts, saved
               activations, the intra-op ILP, its solvers and its memo.
``pipeline/``  stages and schedules: per-stage cost and memory, the stage DP and its range arrays,
               schedules as action lists, their simulator, rule R6's bounds, the zero-bubble search.
``program/``   the Plan as the emitted program runs it: collective records (torch and JAX), sequence
               parallelism's roles, interleaved and V chunk layouts, the candidate -> Plan builder.
``entry/``     the entry points: ``planner.plan_graph``, ``evaluate`` of a hand layout, hand-made and
               best-hand plans, baselines, infeasibility messages, the forked prefetch workers.

Where to change what: ``docs/where-to-change.md``.
"""
