"""Stored traces: the annotated IR graphs of the large built-in zoo models, shipped in ``partita/data``.

Part of the capture stage (``frontends/``), beside ``trace.py``: a cold ``partita compile llama-7b``
spends most of its seconds importing torch / transformers and running ``torch.export`` on the meta
device, although the graph of a built-in model at a given sequence length is the same on every
machine. ``partita/data/traces/<model>.s<seq>.json.gz`` holds that graph (``trace_handle``'s
result: the repeated blocks expanded, the standard passes run), written by
``python -m partita.frontends.stored MODEL...`` (:func:`write_stored`).

A stored graph is used only when it is exactly what a fresh trace would give:

* it is keyed by model name, sequence length and trace batch (``TRACE_BATCH``);
* it records a fingerprint of every source that decides a trace (``frontends/``, ``passes/``,
  ``models/``, ``ir.py``, ``prims.py``) and the installed torch / transformers versions, read with
  ``importlib.metadata`` (no import); any difference and :func:`load_stored` returns ``None``, so
  the driver traces afresh (slower, never wrong); ``PARTITA_STORED_TRACES=off`` always traces afresh;
* the install steps take the transformers release the files were traced with
  (``scripts/constraints.txt``), so a newer release on the registry does not make them all stale;
* ``tests/test_stored_traces.py`` checks that every shipped file is current (else: re-run the
  command above) and that one equals a fresh ``torch.export`` trace, graph hash for graph hash.

Loading imports no torch, transformers or jax (``ir`` and ``sympy`` only).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partita.ir import Graph

PKG = Path(__file__).resolve().parents[1]
TRACES = PKG / "data" / "traces"
FORMAT = 1
# the sources that decide a traced graph (tracers, passes, model configs, the IR and its signatures)
TRACE_SOURCES = ("frontends", "passes", "models", "ir.py", "prims.py")
TRACE_LIBS = ("torch", "transformers")


@functools.cache
def trace_fingerprint() -> str:
    """Hash of the ``.py`` sources in :data:`TRACE_SOURCES` and the versions of :data:`TRACE_LIBS`."""
    h = hashlib.sha256()
    for sub in TRACE_SOURCES:
        root = PKG / sub
        for p in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            if p == Path(__file__).resolve():  # this loader decides no graph
                continue
            h.update(str(p.relative_to(PKG)).encode() + b"\0" + p.read_bytes())
    for lib in TRACE_LIBS:
        try:
            h.update(f"{lib}={metadata.version(lib)}\0".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib}=\0".encode())
    return h.hexdigest()[:16]


def _plain_name(model: str) -> bool:
    """A zoo name (letters, digits, ``-._``), never a path: only those name a file under TRACES."""
    return bool(model) and not model.startswith(".") and all(c.isalnum() or c in "-._" for c in model)


def stored_path(model: str, seq: int) -> Path:
    return TRACES / f"{model}.s{seq}.json.gz"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(gzip.decompress(path.read_bytes())))
    except (OSError, ValueError, EOFError):  # missing, truncated or not JSON: trace afresh
        return None


def stored_is_current(model: str, seq: int, batch: int) -> bool:
    """Does a stored graph exist for (model, seq, batch) whose fingerprint matches these sources?"""
    head = _read(stored_path(model, seq))
    return head is not None and _matches(head, model, seq, batch)


def _matches(d: dict[str, Any], model: str, seq: int, batch: int) -> bool:
    want = {"format": FORMAT, "model": model, "seq": seq, "batch": batch, "fingerprint": trace_fingerprint()}
    return all(d.get(k) == v for k, v in want.items())


def load_stored(model: str, seq: int, batch: int) -> Graph | None:
    """The stored graph of zoo model ``model`` traced at (``batch``, ``seq``), or ``None`` when there is
    none or it is not current (module docstring)."""
    if os.environ.get("PARTITA_STORED_TRACES", "").lower() in ("0", "off", "no") or not _plain_name(model):
        return None
    path = stored_path(model, seq)
    if not path.is_file():
        return None
    d = _read(path)
    if d is None or not _matches(d, model, seq, batch):
        return None
    from partita.ir import graph_from_dict

    return graph_from_dict(d["graph"])


def write_stored(model: str, seq: int, batch: int) -> Path:
    """Trace ``model`` afresh (``trace_handle``, no stored graph) and store the result."""
    from partita.frontends.trace import trace_handle
    from partita.ir import graph_to_dict
    from partita.models import resolve_model

    graph = trace_handle(resolve_model(model), batch=batch, seq=seq)
    body = {
        "format": FORMAT,
        "model": model,
        "seq": seq,
        "batch": batch,
        "fingerprint": trace_fingerprint(),
        "graph_hash": graph.hash(),
        "graph": graph_to_dict(graph),
    }
    path = stored_path(model, seq)
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same graph gives the same bytes (a regenerated file shows in git only if it changed)
    data = gzip.compress(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), mtime=0)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


STORED_MODELS = ("llama-7b", "llama-70b", "gpt3-175b")  # the issue-20 benchmark's models, at seq 2048
STORED_SEQ = 2048


def main(argv: list[str]) -> int:
    """``python -m partita.frontends.stored [MODEL...]``: (re)write the stored traces (default: all)."""
    from partita.frontends.trace import TRACE_BATCH

    for model in argv or STORED_MODELS:
        path = write_stored(model, STORED_SEQ, TRACE_BATCH)
        print(f"{path.relative_to(PKG.parent)}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
