"""Profiling: measure devices and links, fit a calibration profile the cost model reads (``partita profile``; above the backends whose steps it times)."""
