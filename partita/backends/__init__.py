"""Backends: one folder per framework, each holding its emitter and the runtime its programs import (below the driver, above ``plan.py``)."""
