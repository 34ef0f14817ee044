"""The host memory of a rehearsed role: its peak resident set, and the meter of the streamed fill.

Below ``rehearse`` (which reports each role's host peak against the plan's host bound, issue 33); the
fill itself is ``materialize.HostFill``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from partita.backends.torch import materialize


# ---- host memory (issue 33 item 4) -------------------------------------------------------------------
# A role's host peak is measured, not computed: the process's resident peak (``VmHWM``, reset when the role
# starts) over its whole set-up and step, and for the fill the resident size before it plus how far the
# fill's live allocations grew the address space (``VmPeak`` over ``VmSize`` before it). The fill's full
# values are allocated but not written (``torch.empty``: values never matter here); writing them costs the
# page faults of every byte of the stage (a gpt3-175b stage: 140 GB, minutes per role on this machine),
# and an allocation the fill keeps alive past its parameter grows the address space as surely as the
# resident set. Linux ``/proc`` only; elsewhere 0 (no verdict).
def reset_host_peak() -> None:
    """Start the process's peak resident set (``VmHWM``) again from its current size (Linux: writing 5 to
    ``/proc/self/clear_refs``); a forked role then measures its own peak, not its parent's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size (``VmHWM``, ``VmRSS``, ``VmSize``, ``VmPeak``) in bytes, 0 where it is
    not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_peak() -> int:
    """The process's peak resident set in bytes (``VmHWM``)."""
    return status_bytes("VmHWM")


class HostMeter:
    """The host peak of a streamed fill (the section comment): entered around it, ``peak`` is the resident
    size before it plus the growth of the address space's peak during it."""

    def __init__(self) -> None:
        self.peak = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        rss, size = status_bytes("VmRSS"), status_bytes("VmSize")
        try:
            yield
        finally:
            self.peak = rss + max(0, status_bytes("VmPeak") - size)


def host_fill(fake: Any) -> tuple[materialize.HostFill, HostMeter]:
    """The rehearsal's fill (``materialize.HostFill``): full values allocated on the host as the run
    allocates them, unwritten, copied into the fake shards under ``fake``'s permission, measured."""
    meter = HostMeter()

    @contextlib.contextmanager
    def copy_in() -> Iterator[None]:  # the host's full values are real, the shards they are copied into fake
        fake.allow_non_fake_inputs = True
        try:
            with meter.measure():
                yield
        finally:
            fake.allow_non_fake_inputs = False

    return materialize.HostFill(lambda rule: torch.empty(rule.shape), copy_in), meter
