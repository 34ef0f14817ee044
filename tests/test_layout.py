"""The house layout (README, Architecture): the flow is the folder list, and imports only run down it.

Builds the import graph of ``partita/`` with ``ast`` (every import, module-level or inside a
function: a lazy import is still an arrow) and fails on an import circle, on an import that runs
up the layers (or up the rooms of ``partita/search/``), on a module over 800 lines, on a module without a docstring, and on a private torch
API used outside the one shim (``frontends/torch_shim.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "partita"

# Bottom to top. A module may import modules of its own layer or of a lower one.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "version"),
    (
        "user_files",
        "env_check",
        "hf_config_check",
    ),  # reading the user's files and environment: below everything that does
    ("ir", "prims", "plan", "cluster", "device_reserve"),
    ("passes",),
    ("search",),
    ("frontends", "models"),
    ("backends",),
    ("profile",),
    ("report",),
    ("outputs", "run_checks", "progress", "fingerprint", "cli_checks", "gc_freeze"),
    ("driver", "trace_child", "api", "cli", ""),  # "" = the package root (partita/__init__.py)
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_LINES = 800

# The rooms of ``partita/search/``, bottom to top (``partita/search/__init__.py`` says what each owns).
SEARCH_ROOMS = ("pricing", "layer", "pipeline", "program", "entry")
MAX_ROOM_MODULES = 10


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The partita modules ``path`` imports (``from partita.x import y`` counts ``partita.x.y`` when
    that is a module, else ``partita.x``)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                targets.append(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        for t in targets:
            if t == "partita" or t.startswith("partita."):
                while t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in known and t != name:
                    out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, m, known) for m, p in mods.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_has_a_layer() -> None:
    missing = sorted({_layer(m) for m in _modules()} - set(RANK))
    assert not missing, f"add these top-level modules/packages to LAYERS: {missing}"


def test_no_upward_import() -> None:
    bad = [
        f"{m} ({_layer(m)}) imports {t} ({_layer(t)})"
        for m, targets in _graph().items()
        for t in sorted(targets)
        if RANK[_layer(t)] > RANK[_layer(m)]
    ]
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def _room(module: str) -> str | None:
    """``pricing`` for ``partita.search.pricing.cost_model``; None outside the search's rooms."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "search" else None


def test_search_modules_sit_in_rooms() -> None:
    loose = [m for m in _modules() if m.startswith("partita.search.") and _room(m) is None and m.count(".") != 2]
    stray = [
        m
        for m in _modules()
        if m.startswith("partita.search.") and m.count(".") == 2 and m.split(".")[2] not in SEARCH_ROOMS
    ]
    assert not loose and not stray, f"search modules outside the rooms {SEARCH_ROOMS}: {loose + stray}"
    sizes = {r: sum(1 for m in _modules() if _room(m) == r and not m.endswith(".__init__")) for r in SEARCH_ROOMS}
    assert all(0 < n <= MAX_ROOM_MODULES for n in sizes.values()), f"modules per room (1..{MAX_ROOM_MODULES}): {sizes}"


def _up_the_rooms(graph: dict[str, set[str]]) -> list[str]:
    order = {r: i for i, r in enumerate(SEARCH_ROOMS)}
    return [
        f"{m} ({_room(m)}) imports {t} ({_room(t)})"
        for m, targets in graph.items()
        if (room := _room(m)) is not None
        for t in sorted(targets)
        if (up := _room(t)) is not None and order[up] > order[room]
    ]


def test_no_import_up_the_search_rooms() -> None:
    bad = _up_the_rooms(_graph())
    assert not bad, "imports that run up the rooms of partita/search/:\n" + "\n".join(bad)


def test_room_check_finds_an_upward_import() -> None:
    assert _room("partita.search.entry.planner") == "entry"
    assert _room("partita.search") is None and _room("partita.search.layer") is None
    up = {"partita.search.layer.memo": {"partita.search.pipeline.stage_cost", "partita.search.pricing.mesh"}}
    assert _up_the_rooms(up) == [
        "partita.search.layer.memo (layer) imports partita.search.pipeline.stage_cost (pipeline)"
    ]
    assert _up_the_rooms({"partita.search.entry.planner": {"partita.search.layer.memo"}}) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    g = _graph()
    # a package's __init__ that re-exports its own submodules is not a circle with them
    for m in list(g):
        if _modules()[m].name == "__init__.py":
            g[m] = {t for t in g[m] if not t.startswith(m + ".")}
    assert not _cycles(g), f"import circles: {_cycles(g)}"


def test_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_modules_are_small_and_say_where_they_sit() -> None:
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"
    undocumented = [
        m for m, p in _modules().items() if p.stat().st_size and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not undocumented, f"modules without a docstring saying where they sit in the flow: {undocumented}"


PRIVATE_TORCH = re.compile(r"\btorch(?:\.[a-z_]+)*\._[a-z]")
STRINGS = re.compile(r"(['\"])(?:\\.|(?!\1).)*\1")


def test_private_torch_apis_only_through_the_shim() -> None:
    shim = PKG / "frontends" / "torch_shim.py"
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        if p == shim:
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = STRINGS.sub('""', line.split("#", 1)[0])  # a logger's name is not an API call
            if PRIVATE_TORCH.search(code):
                bad.append(f"{p.relative_to(PKG)}:{i}: {line.strip()}")
    assert not bad, "private torch APIs outside frontends/torch_shim.py:\n" + "\n".join(bad)


def test_private_jax_apis_only_through_the_shim() -> None:
    shim = PKG / "frontends" / "jax_shim.py"
    bad = [
        f"{p.relative_to(PKG)}: {line.strip()}"
        for p in sorted(PKG.rglob("*.py"))
        if p != shim
        for line in p.read_text().splitlines()
        if re.search(r"\bjax\._src\b", STRINGS.sub('""', line.split("#", 1)[0]))
    ]
    assert not bad, "private JAX APIs outside frontends/jax_shim.py:\n" + "\n".join(bad)
