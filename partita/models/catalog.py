"""The zoo's catalogue: every built-in model's name, framework, parameter count and description,
shipped in ``partita/data/zoo_catalog.json`` so that ``partita models`` lists them without building one.

Beside ``zoo.py``: ``zoo.list_models()`` builds each model on the meta device to count its parameters
(torch, transformers and jax imported, seconds per model on a loaded machine). The counts depend only
on the zoo's sources and the installed torch / transformers / jax, so they are written once by
``python -m partita.models.catalog`` (:func:`write_catalog`, which calls ``list_models``) with a
fingerprint of those; :func:`load_catalog` returns ``None`` when the fingerprint differs (a source or
a library changed) and the caller builds the models as before (slower, never wrong).
``tests/test_models.py`` checks that the shipped file is current. Loading imports no torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PKG = Path(__file__).resolve().parents[1]
CATALOG = PKG / "data" / "zoo_catalog.json"
LIBS = ("torch", "transformers", "jax", "flax")
FIELDS = ("name", "framework", "num_params", "description")


@functools.cache
def catalog_fingerprint() -> str:
    """Hash of ``models/*.py`` (this file aside: it decides no count) and the versions of :data:`LIBS`."""
    h = hashlib.sha256()
    for p in sorted((PKG / "models").glob("*.py")):
        if p == Path(__file__).resolve():
            continue
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    for lib in LIBS:
        try:
            h.update(f"{lib}={metadata.version(lib)}\0".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib}=\0".encode())
    return h.hexdigest()[:16]


def load_catalog() -> list[dict[str, Any]] | None:
    """The shipped entries (dicts of :data:`FIELDS`) when current, else None."""
    try:
        d = json.loads(CATALOG.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("fingerprint") != catalog_fingerprint():
        return None
    return [dict(m) for m in d.get("models", [])]


def write_catalog() -> Path:
    """Build every zoo model (``zoo.list_models``) and write the catalogue."""
    from partita.models.zoo import list_models

    models = [{f: getattr(m, f) for f in FIELDS} for m in list_models()]
    body = {"fingerprint": catalog_fingerprint(), "models": models}
    tmp = CATALOG.with_name(CATALOG.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(CATALOG)
    return CATALOG


if __name__ == "__main__":
    print(write_catalog().relative_to(PKG.parent))
    sys.exit(0)
