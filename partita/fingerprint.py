"""What makes two compiles the same: the model's identity, the code's fingerprint, the cache key.

Below the driver (which caches plans under :func:`cache_key`) and beside ``outputs`` (which stores the
files of an entry with their hashes). ``partita compile`` answers a cache hit from :func:`spec_identity`
without importing torch."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.cluster import Cluster
from partita.version import __version__


def _model_identity(handle: Any) -> str:
    """What decides the traced graph: the zoo config, or the content of the user's file."""
    ident = getattr(handle, "identity", None)
    if callable(ident):
        return str(ident())
    cfg = getattr(handle, "config", {})
    return json.dumps(
        {"name": handle.name, "framework": handle.framework, "config": cfg if isinstance(cfg, Mapping) else repr(cfg)},
        sort_keys=True,
        default=str,
    )


def _profile_hash(path: str) -> str:
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.exists() else "missing:" + path


@functools.cache
def code_fingerprint() -> str:
    """Hash of the sources that decide a plan (IR, passes, search, tracers, emitters, data files).

    The version string alone misses edits between releases (an editable install, a patched
    pass); a stale cached plan would then disagree with a fresh trace (its ``graph_hash``)."""
    return source_fingerprint(
        ("ir.py", "prims.py", "plan.py", "cluster.py", "passes", "search", "frontends", "backends", "models", "data")
    )


def source_fingerprint(subs: Sequence[str]) -> str:
    """Hash of the ``.py`` / ``.json`` files under these paths of the ``partita`` package."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for sub in subs:
        for p in sorted((root / sub).rglob("*") if (root / sub).is_dir() else [root / sub]):
            if p.is_file() and p.suffix in (".py", ".json"):
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def spec_identity(spec: str) -> str | None:
    """A model identity from the spec string alone (no torch / transformers import), or None.

    Zoo names are code (``models/`` is in :func:`code_fingerprint`, library versions are added
    here); a ``config.json`` is its content. A ``package.module:factory`` needs its module run,
    so it has none. Lets ``partita compile`` answer a cache hit without importing torch."""
    from importlib import metadata

    if ":" in spec and not Path(spec).exists():
        return None
    base, _, task = spec.rpartition("#") if "#" in spec else (spec, "", "")
    path = Path(base)
    if path.is_dir() and (path / "config.json").is_file():  # a model directory: its config.json (models/hf.py)
        path = path / "config.json"
    if task and path.is_file():  # `--task` rides on the spec: same file, another model
        return json.dumps({"spec": spec_identity(str(path)), "task": task}, sort_keys=True)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            return None
        body = "file:" + hashlib.sha256(path.read_bytes()).hexdigest()
    else:
        body = "zoo:" + spec
    versions = {}
    for lib in ("torch", "transformers", "jax", "flax"):
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = ""
    return json.dumps({"spec": body, "versions": versions}, sort_keys=True)


def cache_key(handle: Any, cluster: Cluster, training: Any, identity: str | None = None) -> str:
    payload = {
        "code": code_fingerprint(),
        "model": identity if identity is not None else _model_identity(handle),
        "cluster": cluster.fingerprint(),
        "training": dataclasses.asdict(training) if dataclasses.is_dataclass(training) else dict(training),
        "partita": __version__,
        # a re-measured profile written to the same path must not hit a stale plan
        "profiles": {d.name: _profile_hash(d.profile) for d in cluster.device_types() if d.profile},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]
