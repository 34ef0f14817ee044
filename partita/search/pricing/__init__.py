"""Pricing: what one device type and one link cost, and the frozen inputs every price depends on.

Owns the analytic cost model (roofline compute per dtype, alpha-beta collectives per link class,
training memory; ``cost_model``), logical meshes and the link each axis crosses (``mesh``), the
plan's training precision and why a device type sits idle (``precision``), and the training and
search configuration (``config``). The bottom room of ``partita.search``: it imports only
``partita.cluster`` / ``ir`` / ``plan`` / ``errors``, nothing else of the search.
"""
