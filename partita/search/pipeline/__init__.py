"""The pipeline: stages, schedules and the step they simulate to.

Owns per-stage cost and memory from layer solutions with ZeRO, recompute and gradient-sync overlap
(``stage_cost``) and its per-range arrays (``stage_ranges``), the stage DP (``inter_op``), schedules
as per-rank action lists (``schedule``), their event simulation (``pipeline_sim``, ``schedule_cost``),
rule R6's lower bounds (``step_bounds``) and the zero-bubble search (``zero_bubble``). Change here to
change how a stage is priced or how the step is simulated. May import ``search.layer`` and
``search.pricing``, nothing above.
"""
