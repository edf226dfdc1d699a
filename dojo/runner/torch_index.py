"""Whether PyTorch's CPU-only wheel index answers, and if not, why: its host name did not
resolve, it did not answer in time, or something else (a refusal, an HTTP error, a proxy).

The set-up (the Makefile) asks before it installs the CPU-only build, and ``dojo doctor`` asks
before it advises that build. Standard library only: the Makefile runs it with the system's
Python, before the environment exists.

    python -m dojo.runner.torch_index [URL] [SECONDS]   # prints why not; exit status 1 if not
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import urllib.error
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_S = 5.0  # how long to wait for an answer (pip itself would wait 180 s, then retry)


def unreachable(index: str = CPU_INDEX, seconds: float = PROBE_S) -> str | None:
    """None when ``index``'s page for torch answers within ``seconds``; else why not, in words
    that fit after "it cannot be reached: " ("its host name did not resolve in 0.1 s (Name or
    service not known)")."""
    answer: list[str | None] = []
    # Name resolution has no timeout of its own: the question goes on in a thread of its own.
    asking = threading.Thread(target=lambda: answer.append(_ask(index, seconds)), daemon=True)
    asking.start()
    asking.join(seconds + 1.0)
    if not answer:
        return f"no answer within {seconds:g} s (its host name was still being looked up)"
    return answer[0]


def _ask(index: str, seconds: float) -> str | None:
    url = index.rstrip("/") + "/torch/"
    start = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=seconds):
            return None
    except urllib.error.HTTPError as error:
        return f"it answered HTTP {error.code} ({error.reason}) for {url}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        took = time.monotonic() - start
        cause = getattr(error, "reason", error)
        if isinstance(cause, socket.gaierror):
            return f"its host name did not resolve in {took:.1f} s ({cause.strerror or cause})"
        if isinstance(cause, TimeoutError) or "timed out" in str(cause):
            return f"it did not answer within {seconds:g} s"
        if isinstance(cause, ConnectionRefusedError):
            return f"the connection was refused in {took:.1f} s"
        return f"{cause}, after {took:.1f} s"


def main(argv: list[str]) -> int:
    index = argv[0] if argv else CPU_INDEX
    seconds = float(argv[1]) if len(argv) > 1 else PROBE_S
    why = unreachable(index, seconds)
    if why:
        print(why)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
