"""The Partita version: recorded in every Plan and in the compile cache key (bottom of the flow)."""

__version__ = "0.1.0"
