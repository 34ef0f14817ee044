"""The rehearsal's point-to-point world: every rank of a pipeline played together, send by receive.

Each rehearsed role (``rehearse.rehearse_rank``) runs its own program on a fake process group, where a
receive returns at once; alone, a rank cannot see that its peer never sends. So each role records, in
issue order, every ``c10d`` send and receive its program's schedule issues (``rehearse.StepRecorder``:
``[op, peer, bytes, tag, label, group]``, the group as the program named it on the call), and :func:`match_world` plays those lists together, one cursor per
rank, with the blocking rules the program runs under:

* a send is asynchronous (``dist.isend`` in ``P2PPipeline``; the send half of a batch in
  ``torch.distributed.pipelining``, whose 1F1B and GPipe post a batch's sends before its receives):
  the rank goes on; the send waits, posted, for its receive;
* a receive blocks its rank until the matching send is posted (``dist.recv`` in ``P2PPipeline``;
  ``_wait_batch_p2p`` right after the batch in torch's schedules);
* on a GPU plan (``in_order``: NCCL, which matches point-to-point operations between two ranks of one
  communicator in issue order and ignores tags) sends and receives between two ranks on one process
  group pair in issue order, so a pair whose tags or sizes differ is a message delivered to the wrong
  action: reported as a wrong order (``P2PPipeline`` gives each message stream its own group for this
  reason); on a CPU plan (gloo, which matches a receive with the next send of its tag from its peer on
  the group) they pair per group and tag, in order, and only sizes must agree.

What is left when no cursor moves is the finding, by name: a deadlock (each waiting rank, the action
whose receive it waits at, and what its peer is doing), a receive whose peer ended its step without the
send, a send whose peer ended without receiving it. Playing recorded lists cannot hang, so no timeout
is needed: a world that stops moving is the report.

A *label* names the schedule action an operation belongs to, in the program's own action notation
(``F1.2 recv``: the forward of stage 1, micro-batch 2, its receive). ``P2PPipeline`` tags every message
``2 * (micro * num_virtual + stage) (+ 1 backward)`` (its ``_tag``), so the label is read back from the
tag; torch's schedules tag nothing, so :func:`label_torch_stage` wraps the ``PipelineStage``'s
``get_{fwd,bwd}_{recv,send}_ops`` of the running schedule and names each operation as the schedule
asks for it. An operation outside any action (a send after the schedule) is labelled so.

A peer that was not rehearsed (a tp rank folded into tp rank 0, a replica with a batch share already
played) is not played: operations with it are not checked (``rehearse.roles`` says which ranks play).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Label = Callable[[str, int, int], str]  # (op "send" / "recv", peer global rank, tag) -> label
OUTSIDE = "outside the schedule"


@dataclasses.dataclass(frozen=True)
class Op:
    """One recorded point-to-point operation of a rank, in its issue order."""

    op: str  # "send" | "recv"
    peer: int  # global rank
    bytes: int
    tag: int
    label: str
    group: str = ""  # the process group's name (NCCL pairs per communicator): "" where not recorded


def ops_of(records: Sequence[Sequence[Any]]) -> list[Op]:
    """A role's ``RankResult.p2p`` rows as :class:`Op` (rows without tag / label / group: 0, ``OUTSIDE``,
    "")."""
    out = []
    for row in records:
        op, peer, n = str(row[0]), int(row[1]), int(row[2])
        tag = int(row[3]) if len(row) > 3 else 0
        label = str(row[4]) if len(row) > 4 else OUTSIDE
        out.append(Op(op, peer, n, tag, label, str(row[5]) if len(row) > 5 else ""))
    return out


# ---- labels: which schedule action an operation belongs to --------------------------------------------
def label_p2p_pipeline(num_virtual: int, num_micro_batches: int) -> Label:
    """Labels of ``P2PPipeline`` messages, read from their tags (its ``_tag``): a forward message of
    virtual stage ``s`` is sent by ``F{s-1}`` and received by ``F{s}``; a backward one of ``s`` is sent
    by ``B{s}`` and received by ``B{s-1}``."""

    def label(op: str, peer: int, tag: int) -> str:
        backward, q = tag % 2, tag // 2
        stage, micro = q % num_virtual, q // num_virtual
        if tag < 0 or micro >= num_micro_batches or stage == 0:
            return f"tag {tag} ({OUTSIDE})"
        if backward:
            return f"B{stage}.{micro} send" if op == "send" else f"B{stage - 1}.{micro} recv"
        return f"F{stage - 1}.{micro} send" if op == "send" else f"F{stage}.{micro} recv"

    return label


def label_torch_stage(schedule: Any) -> Label:
    """Labels of a ``torch.distributed.pipelining`` single-stage schedule's messages: its stage's
    ``get_fwd_recv_ops`` / ``get_fwd_send_ops`` / ``get_bwd_recv_ops`` / ``get_bwd_send_ops`` are
    wrapped so that every operation the schedule asks for is queued with its action name, per (op,
    peer); the recorder takes them in the order the schedule issues them (``_batch_p2p`` issues a
    batch's operations in list order). ``schedule._stage`` is torch's private attribute of
    ``PipelineScheduleSingle`` (torch 2.4 to 2.13)."""
    stage = getattr(schedule, "_stage", None)
    queued: dict[tuple[str, int], collections.deque[str]] = collections.defaultdict(collections.deque)
    if stage is None:
        return lambda op, peer, tag: OUTSIDE
    index = int(getattr(stage, "stage_index", 0))

    def wrap(name: str, kind: str) -> None:
        real = getattr(stage, name)

        def asked(chunk: int) -> Any:
            ops = real(chunk)
            for p2p in ops:
                op = "send" if "send" in getattr(p2p.op, "__name__", "") else "recv"
                queued[(op, int(p2p.peer))].append(f"{kind}{index}.{chunk} {op}")
            return ops

        setattr(stage, name, asked)

    for name, kind in (("get_fwd_recv_ops", "F"), ("get_fwd_send_ops", "F")):
        wrap(name, kind)
    for name, kind in (("get_bwd_recv_ops", "B"), ("get_bwd_send_ops", "B")):
        wrap(name, kind)

    def label(op: str, peer: int, tag: int) -> str:
        q = queued.get((op, peer))
        return q.popleft() if q else OUTSIDE

    return label


def labeler(runner: Any, program: Mapping[str, Any]) -> Label | None:
    """The label function for the program's runner (None: a runner without point-to-point)."""
    from partita.backends.torch.schedule import P2PPipeline, TorchPipeline

    if isinstance(runner, P2PPipeline):
        return label_p2p_pipeline(runner.n, int(program["num_micro_batches"]))
    if isinstance(runner, TorchPipeline):
        return label_torch_stage(runner.schedule)
    return None


# ---- the world ---------------------------------------------------------------------------------------
def match_world(
    world: Mapping[int, Sequence[Op]], stage_of: Mapping[int, int], *, in_order: bool = True
) -> dict[int, list[str]]:
    """Play every rank's operations together (module docstring); per rank, what does not pair, in
    words (empty: every send met its receive, in order, and every rank ran to the end of its step).
    ``in_order``: NCCL's matching (per pair and group, in issue order); else gloo's (per pair, group and
    tag). A send and a receive on different groups never pair."""
    pc = {r: 0 for r in world}
    # a channel: (src, dst, group) under NCCL, (src, dst, group, tag) under gloo; its sends in order
    posted: dict[tuple[int, ...], list[Op]] = collections.defaultdict(list)
    taken: dict[tuple[int, ...], int] = collections.defaultdict(int)
    wrong: dict[tuple[int, ...], list[str]] = collections.defaultdict(list)
    moved = True
    while moved:
        moved = False
        for r in sorted(world):
            ops = world[r]
            while pc[r] < len(ops):
                o = ops[pc[r]]
                if o.peer not in world:  # a rank not played (folded): not checked
                    pc[r] += 1
                elif o.op == "send":
                    posted[_channel(r, o.peer, o, in_order)].append(o)
                    pc[r] += 1
                else:
                    pair = _channel(o.peer, r, o, in_order)
                    k = taken[pair]
                    if k >= len(posted[pair]):
                        break  # blocked until the peer posts its send
                    s = posted[pair][k]
                    taken[pair] += 1
                    if s.tag != o.tag or s.bytes != o.bytes:
                        wrong[pair].append(_wrong(o, s, r, stage_of, k))
                    pc[r] += 1
                moved = True
    out: dict[int, list[str]] = collections.defaultdict(list)
    for channel, found in wrong.items():
        more = f" (and {len(found) - 1} more pairs after it)" if len(found) > 1 else ""
        for who in set(channel[:2]):
            out[who].append(found[0] + more)
    done = {r for r in world if pc[r] >= len(world[r])}
    for r in sorted(set(world) - done):
        o = world[r][pc[r]]
        out[r].append(_waiting(r, o, world, pc, done, stage_of))
    for channel, sends in sorted(posted.items()):
        a, b = channel[:2]
        if b in done and taken[channel] < len(sends):
            s = sends[taken[channel]]
            extra = len(sends) - taken[channel]
            why = (
                f"p2p: {_who(a, stage_of)} {s.label} ({_fmt(s.bytes)}) to {_who(b, stage_of)} has no receive: rank {b} "
                f"ended its step with {extra} of rank {a}'s sends unreceived (the pipeline would hang)"
            )
            for who in {a, b}:
                out[who].append(why)
    return dict(out)


def _channel(src: int, dst: int, o: Op, in_order: bool) -> tuple[Any, ...]:
    return (src, dst, o.group) if in_order else (src, dst, o.group, o.tag)


def _who(rank: int, stage_of: Mapping[int, int]) -> str:
    return f"rank {rank} (stage {stage_of.get(rank, '?')})"


def _wrong(o: Op, s: Op, r: int, stage_of: Mapping[int, int], k: int) -> str:
    what = []
    if s.tag != o.tag:
        what.append(f"tag {s.tag} sent, {o.tag} expected")
    if s.bytes != o.bytes:
        what.append(f"{_fmt(s.bytes)} sent, {_fmt(o.bytes)} expected")
    return (
        f"p2p: wrong order: {_who(r, stage_of)} {o.label} from {_who(o.peer, stage_of)} receives, as message "
        f"{k + 1} between them, what {s.label} sent ({', '.join(what)})"
    )


def _waiting(
    r: int, o: Op, world: Mapping[int, Sequence[Op]], pc: Mapping[int, int], done: set[int], stage_of: Mapping[int, int]
) -> str:
    p = o.peer
    head = f"{_who(r, stage_of)} waits at {o.label} from {_who(p, stage_of)}"
    if p in done:
        return (
            f"p2p: {head}, which ended its step without that send (a receive without its send: the pipeline would hang)"
        )
    q = world[p][pc[p]]
    return f"p2p: deadlock: {head}, which itself waits at {q.label} from {_who(q.peer, stage_of)}"


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"
