"""Placement by device type: which node runs which plan ranks, the per-node torchrun commands, SLURM.

Used by ``backends/torch/launch.py`` (``partita run DIR --hostfile FILE [--dry-run]``) and, at start-up,
by every rank of the generated program (``train.py`` calls :func:`check_device`).

Where a plan rank runs. ``plan.cluster["rank_map"]`` maps plan rank ``p`` to cluster rank
``rank_map[p]``; the cluster spec's groups number cluster ranks node by node (``Cluster.ranks``), so
each plan rank has a device type and a cluster node. Plan ranks on one node are consecutive, and nodes
are in plan-rank order, because the planner takes the used cluster ranks in order. A plan without
``rank_map`` (hand-made) places its ranks in order, a new node at each change of device type and
whenever a node of that type is full (``gpus_per_node``).

How torchrun is made to honour it: one command per node with that node's own ``--nproc-per-node`` and
``--node-rank`` and a static rendezvous (``--master-addr`` / ``--master-port``): torch's elastic agent
numbers global ranks by node rank, then local rank, so node ``k`` gets exactly the plan ranks the plan
put there, and ``LOCAL_RANK`` is the GPU index on that node.

The hostfile: one node per line, ``HOST device=TYPE [slots=N]`` (``#`` starts a comment). The ``i``-th
host of a device type is that type's ``i``-th node. A hostfile that lacks hosts of a type, has too few
slots, or names a device type the plan does not know is refused (:class:`HostfileError`, exit 2).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.errors import ConfigError, PlanError

MASTER_PORT = 29500


class HostfileError(ConfigError):
    """A hostfile that cannot host the plan (exit 2, nothing started)."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    device: str
    slots: int | None = None


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of the launch: its node rank, host, device type and the plan ranks it runs."""

    node_rank: int
    host: str
    device: str
    ranks: tuple[int, ...]

    @property
    def nproc(self) -> int:
        return len(self.ranks)


def parse_hostfile(path: str | Path) -> list[Host]:
    p = Path(path)
    if not p.is_file():
        raise HostfileError(f"hostfile {p} does not exist.", "pass --hostfile with a file of `HOST device=TYPE` lines.")
    hosts, seen = [], set()
    for no, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *fields = line.split()
        kv = dict(f.split("=", 1) for f in fields if "=" in f)
        bad = [f for f in fields if "=" not in f] + [k for k in kv if k not in ("device", "slots")]
        if bad or "device" not in kv or (kv.get("slots") and not kv["slots"].isdigit()):
            raise HostfileError(
                f"{p} line {no} ({raw.strip()!r}) is not `HOST device=TYPE [slots=N]`.",
                "write one node per line, e.g. `node01 device=H100-80G slots=8`.",
            )
        if name in seen:
            raise HostfileError(f"{p} lists host {name} twice (line {no}).", "list every node once.")
        seen.add(name)
        hosts.append(Host(name, kv["device"], int(kv["slots"]) if kv.get("slots") else None))
    if not hosts:
        raise HostfileError(f"{p} names no host.", "write one node per line, e.g. `node01 device=H100-80G slots=8`.")
    return hosts


def rank_devices(plan: Any) -> list[str]:
    """Device type of every plan rank (a mixed stage: its replica's type, all tp ranks of it)."""
    out = [""] * plan.world_size
    for s in plan.stages:
        for pos, r in enumerate(s.ranks):
            types = s.replica_device_types
            out[r] = types[pos // s.tp] if types else s.device_type
    return out


def _groups(plan: Any) -> list[Mapping[str, Any]]:
    return list(plan.cluster.get("spec", {}).get("groups", []))


def device_spec(plan: Any, name: str) -> Mapping[str, Any]:
    for g in _groups(plan):
        if g["device"]["name"] == name:
            return g["device"]
    return {"name": name, "kind": "cpu" if name.upper().startswith("CPU") else "gpu"}


def plan_nodes(plan: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(device type, plan ranks)`` per node, in node-rank order (module docstring)."""
    devs = rank_devices(plan)
    rank_map = plan.cluster.get("rank_map")
    groups = _groups(plan)
    if rank_map and groups and len(rank_map) == plan.world_size:
        cluster_node: list[int] = []
        node = 0
        for g in groups:
            for _ in range(int(g["num_nodes"])):
                cluster_node += [node] * int(g["gpus_per_node"])
                node += 1
        by_node: dict[int, list[int]] = {}
        for p, c in enumerate(rank_map):
            by_node.setdefault(cluster_node[int(c)], []).append(p)
        return [(devs[rs[0]], tuple(rs)) for _, rs in sorted(by_node.items())]
    per = {g["device"]["name"]: int(g["gpus_per_node"]) for g in groups}
    out: list[tuple[str, list[int]]] = []
    for p, d in enumerate(devs):
        if not out or out[-1][0] != d or len(out[-1][1]) >= per.get(d, plan.world_size):
            out.append((d, []))
        out[-1][1].append(p)
    return [(d, tuple(rs)) for d, rs in out]


def place(plan: Any, hosts: Sequence[Host]) -> list[Node]:
    """Give each node of the plan a host of its device type; refuse a hostfile that cannot."""
    wanted = plan_nodes(plan)
    types = {d for d, _ in wanted}
    unknown = sorted({h.device for h in hosts} - types - {g["device"]["name"] for g in _groups(plan)})
    if unknown:
        raise HostfileError(
            f"the hostfile names device type(s) {', '.join(unknown)}, which the plan's cluster does not have "
            f"(it uses {', '.join(sorted(types))}).",
            "write each host's device type as the cluster spec names it (see `partita clusters`).",
        )
    free: dict[str, list[Host]] = {}
    for h in hosts:
        free.setdefault(h.device, []).append(h)
    need = {d: sum(1 for x, _ in wanted if x == d) for d in types}
    short = [
        f"{n} {d} node(s), the hostfile lists {len(free.get(d, []))}"
        for d, n in sorted(need.items())
        if len(free.get(d, [])) < n
    ]
    if short:
        raise HostfileError(
            f"the hostfile does not cover the plan: it needs {'; '.join(short)}.",
            "add a `HOST device=TYPE` line for every node the plan uses, or recompile for the nodes you have.",
        )
    nodes = []
    for k, (d, ranks) in enumerate(wanted):
        h = free[d].pop(0)
        if h.slots is not None and h.slots < len(ranks):
            raise HostfileError(
                f"host {h.name} has slots={h.slots}, but the plan puts {len(ranks)} ranks ({d}) on that node.",
                f"give {h.name} slots={len(ranks)} or more, or recompile for smaller nodes.",
            )
        nodes.append(Node(k, h.name, d, ranks))
    covered = sorted(r for n in nodes for r in n.ranks)
    if covered != list(range(plan.world_size)):
        raise PlanError(f"the plan's nodes cover ranks {covered}, not 0..{plan.world_size - 1}.", "recompile the plan.")
    return nodes


def node_command(
    node: Node, nodes: Sequence[Node], python: str, program: str, args: Sequence[str], max_restarts: int = 0
) -> list[str]:
    """The torchrun command node ``node`` runs (static rendezvous at the first node's host)."""
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--node-rank", str(node.node_rank)]
    cmd += ["--nproc-per-node", str(node.nproc), "--master-addr", nodes[0].host, "--master-port", str(MASTER_PORT)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return [*cmd, program, *args]


def sbatch_script(nodes: Sequence[Node], commands: Sequence[Sequence[str]], job: str = "partita") -> str:
    """A SLURM batch script that starts each node's own command on its host (``srun -w HOST``)."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={len(nodes)}",
        f"#SBATCH --nodelist={','.join(n.host for n in nodes)}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "# Generated by `partita run DIR --hostfile FILE`: node k runs the plan ranks the plan put on it.",
        "set -euo pipefail",
    ]
    for n, cmd in zip(nodes, commands):
        lines.append(f"# node {n.node_rank}: {n.host} ({n.device}), plan ranks {n.ranks[0]}..{n.ranks[-1]}")
        lines.append(f"srun --nodes=1 --ntasks=1 -w {shlex.quote(n.host)} {' '.join(shlex.quote(c) for c in cmd)} &")
    lines += ["wait", ""]
    return "\n".join(lines)


# ---- start-up check inside each rank -------------------------------------------------------------
def _model_token(name: str) -> str:
    """``H100-80G`` -> ``h100``; ``A100-40G`` -> ``a100``; ``L4`` -> ``l4``."""
    return re.split(r"[-_ ]", name.strip())[0].lower()


def check_device(expected: Mapping[str, Any], actual_name: str, actual_memory: int, rank: int) -> None:
    """Refuse to run plan rank ``rank`` on a GPU of another type or with less memory than the plan assumed."""
    want = str(expected.get("name", ""))
    token = _model_token(want)
    words = re.split(r"[^a-z0-9]+", actual_name.lower())
    if token and token not in words:
        raise PlanError(
            f"plan rank {rank} was planned for a {want} but runs on a {actual_name!r}.",
            "launch with `partita run DIR --hostfile FILE` so each node runs the ranks of its device type, "
            "or fix the node's device= entry in the hostfile.",
        )
    mem = float(expected.get("memory_bytes", 0) or 0)
    if mem and actual_memory < 0.9 * mem:
        raise PlanError(
            f"plan rank {rank} was planned for a {want} with {mem / 2**30:.0f} GiB but this GPU "
            f"({actual_name}) has {actual_memory / 2**30:.0f} GiB.",
            "run on nodes with the memory the plan assumed, or recompile for this GPU.",
        )
