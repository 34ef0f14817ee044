"""The layer problem: one sharding strategy per op of one layer on one ``(1, tp)`` mesh (after Alpa).

Owns each op's strategies read off its dimension signature (``strategies``, ``layer_strategies``),
resharding between two layouts (``reshard``), the activations the program saves for the backward
(``saved``), the ILP and its exact solvers (``intra_op``, ``ilp``) and the memo that solves a repeated
layer once (``memo``). Change here to change how one op is sharded or priced. May import
``search.pricing`` (and ``partita.ir`` / ``plan`` / ``passes``), nothing above.
"""
