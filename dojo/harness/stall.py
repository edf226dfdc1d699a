"""Whether a world's ranks still make progress: the CPU time they (and what they started) use.

A world makes progress while a rank returns, or while its waiting ranks burn CPU (computing,
importing, starting processes: not blocked in a collective). Where the CPU time cannot be read
(no ``/proc``), only ranks that have returned while others have not count as a stall: a long
computation is never taken for a hang.
"""

from __future__ import annotations

import os
import time

# Of one core, summed over the waiting ranks: less than this is idle. Ranks blocked in gloo use
# about 0.3 %; on a machine loaded 20 processes to a core a working rank still gets 5 %.
_BUSY_FRACTION = 0.02
_SAMPLE_S = 1.0  # CPU time moves in clock ticks (10 ms): shorter samples would be noise


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(groups: list[int]) -> float | None:
    """CPU time of every process in these process groups (a rank leads its own, and the
    processes it starts join it), the children they have reaped included; None without /proc."""
    if not os.path.isdir("/proc"):
        return None
    wanted, total = set(groups), 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in wanted:  # fields[2]: the process group
            total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return total / os.sysconf("SC_CLK_TCK")


class StallWatch:
    """``watch.check(waiting_pids, returned)`` once in a while; ``stalled_for`` says how long
    nothing has moved."""

    def __init__(self):
        self.last_progress = time.monotonic()
        self._cpu: float | None = None
        self._returned = 0
        self._checked = self.last_progress

    def check(self, waiting_pids: list[int], returned: int) -> float:
        """Record what moved since the last check; the seconds since anything last did."""
        now = time.monotonic()
        if returned > self._returned:
            self.last_progress, self._returned = now, returned
        if now - self._checked < _SAMPLE_S:
            return now - self.last_progress
        samples = [cpu_seconds(pid) for pid in waiting_pids]
        cpu = None if any(s is None for s in samples) else sum(samples)
        busy = (
            cpu is not None
            and self._cpu is not None
            and cpu - self._cpu >= _BUSY_FRACTION * (now - self._checked)
        )
        if busy or (cpu is None and returned == 0):
            self.last_progress = now
        self._cpu, self._returned, self._checked = cpu, returned, now
        return now - self.last_progress

    def moved(self) -> None:
        """Start counting afresh (after a report, or when the caller knows something moved)."""
        self.last_progress = time.monotonic()


class BusyWatch:
    """Whether the processes of some groups used the CPU lately: ``watch.busy(groups)`` is True
    when they did since the last call that returned (a second or more ago); a deadline that
    would end a world now waits while its ranks are still at work (a loaded machine, a rank
    importing torch in a process it started), not while they sit idle."""

    def __init__(self, every: float = 1.0):
        self.every = every
        self._cpu: float | None = None
        self._checked = 0.0
        self._busy = True  # until measured: a world that just started is starting

        self._groups: list[int] = []

    def busy(self, groups: list[int]) -> bool:
        now = time.monotonic()
        if now - self._checked >= self.every or groups != self._groups:
            cpu = group_cpu_seconds(groups)
            if cpu is None:
                self._busy = False  # cannot tell: deadlines are what they say
            elif self._cpu is not None and groups == self._groups:
                self._busy = cpu - self._cpu >= _BUSY_FRACTION * (now - self._checked)
            self._cpu, self._checked, self._groups = cpu, now, list(groups)
        return self._busy
