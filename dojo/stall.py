"""Whether a world without a deadline (a program) still makes progress.

A world makes progress while a rank returns, or while its waiting ranks burn CPU (computing,
not blocked in a collective). Where the CPU time cannot be read (no ``/proc``), only ranks that
have returned while others have not count as a stall: a long computation is never taken for
a hang.
"""

from __future__ import annotations

import os
import time

_BUSY_FRACTION = 0.1  # of one core, summed over the waiting ranks: less than this is idle


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        samples = [cpu_seconds(pid) for pid in waiting_pids]
        cpu = None if any(s is None for s in samples) else sum(samples)
        busy = (
            cpu is not None
            and self._cpu is not None
            and cpu - self._cpu >= _BUSY_FRACTION * (now - self._checked)
        )
        if returned > self._returned or busy or (cpu is None and returned == 0):
            self.last_progress = now
        self._cpu, self._returned, self._checked = cpu, returned, now
        return now - self.last_progress

    def moved(self) -> None:
        """Start counting afresh (after a report, or when the caller knows something moved)."""
        self.last_progress = time.monotonic()
