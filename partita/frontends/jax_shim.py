"""The one place Partita touches private JAX APIs (the twin of ``torch_shim.py``).

Used by ``frontends/trace_jax.py`` for provenance. A JAX upgrade that moves these touches only
this file; every use is guarded so a missing private API degrades provenance, never tracing.
"""

from __future__ import annotations

import os
from typing import Any


def user_source(source_info: Any) -> str:
    """``file.py:line`` of the user frame of a jaxpr equation's ``source_info`` ("" when unknown)."""
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(source_info.traceback)
    except Exception:  # noqa: BLE001 - provenance is best effort, never a tracing failure
        return ""
    return f"{os.path.basename(frame.file_name)}:{frame.start_line}" if frame else ""
