"""Test helper (issue 15 closed forms): rehearse rank 0 of a plan directory and print the memory the
step holds, by category, at the moment its first backward starts (the saved activations of every
layer, before any is freed), as one JSON line.

``partita rehearse`` keeps only the step's peak. Under recompute the peak falls inside the backward,
where gradients grow as activations are freed, so a difference of peaks between two depths is not the
bytes a layer keeps; this probe reads the same rehearsal (``backends/torch/rehearse.rehearse_rank``,
unchanged) at the forward/backward boundary instead: it wraps ``torch_shim.mem_tracker`` to keep the
tracker and ``torch.autograd.backward`` to read the tracker's current snapshot on its first call.

Usage: ``python tests/runtime/saved_probe.py PLAN_DIR...`` (pp = 1 plans: one stage, one backward); one
line per directory, ``{"dir", "at_backward", "peak", "collectives"}``. Several directories are played in
children forked after the imports (a fresh DTensor state each, as ``rehearse.run_roles`` does).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def probe(plan_dir: str) -> dict[str, Any]:
    import torch

    from partita.backends.torch import rehearse
    from partita.backends.torch.launch import load_program
    from partita.frontends import torch_shim

    trackers: list[Any] = []
    at_backward: list[dict[str, int]] = []
    make = torch_shim.mem_tracker

    def keep(peak_only: bool = False) -> Any:
        trackers.append(make(peak_only=peak_only))
        return trackers[-1]

    inner = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        if trackers and not at_backward:
            snap = next(iter(trackers[-1].get_tracker_snapshot("current").values()), {})
            at_backward.append({str(getattr(k, "value", k)): int(v) for k, v in snap.items()})
        return inner(*args, **kwargs)

    torch_shim.mem_tracker = keep  # type: ignore[assignment]
    torch.autograd.backward = backward  # type: ignore[assignment]
    res = rehearse.rehearse_rank(load_program(plan_dir), 0)
    return {
        "dir": plan_dir,
        "at_backward": at_backward[0] if at_backward else {},
        "peak": res.memory_by_category,
        "collectives": res.collectives,
    }


def main(dirs: list[str]) -> None:
    import os

    import torch  # noqa: F401 - imported once, before the forks

    import partita.backends.torch.rehearse  # noqa: F401
    from partita.models.zoo import resolve_model  # noqa: F401

    pids = []
    for d in dirs:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                print(json.dumps(probe(d)), flush=True)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    bad = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
