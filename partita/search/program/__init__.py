"""The Plan as the emitted program runs it: records, chunk layouts, the candidate -> Plan builder.

Owns the Plan's collective records for torch (``records``) and JAX (``jax_records``), sequence
parallelism's roles and records on a hand layout (``sequence_parallel``), the interleaved and ZB-V
chunk layouts the runtime runs (``chunk_layout``, ``v_layout``), and turning a priced candidate into
a :class:`~partita.plan.Plan` (``plan_build``). Change here when the program issues a collective or
lays out a chunk differently. May import ``search.pipeline``, ``search.layer`` and
``search.pricing``, nothing above.
"""
