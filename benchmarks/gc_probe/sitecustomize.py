"""Times every garbage collection over 5 ms in each Python process started with this
folder on ``PYTHONPATH`` (site imports ``sitecustomize``), a line each to
``$LORAPOOL_GC_LOG`` (default ``gc.log`` in the process's working folder): the monotonic
clock, the pid, the generation, the milliseconds, the objects collected and the end of
the command line (which process it was). How the gateway's full collections under a
hostile tenant's flood were found (benchmarks/RESULTS.md, session 19):

    PYTHONPATH=benchmarks/gc_probe LORAPOOL_GC_LOG=/tmp/gc.log \\
        python benchmarks/hostile_tenants.py --model DIR ...
"""

import gc
import os
import time

_LOG = os.path.abspath(os.environ.get("LORAPOOL_GC_LOG", "gc.log"))
_started: list[float] = []


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
        return
    took = time.perf_counter() - (_started[0] if _started else time.perf_counter())
    if took <= 0.005:
        return
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            raw = cmdline.read().replace(b"\0", b" ").replace(b"\n", b" ")
        command = raw[-60:].decode("utf-8", "replace")
    except OSError:
        command = "?"
    with open(_LOG, "a") as log:
        log.write(
            f"{time.monotonic():.3f} pid={os.getpid()} gen={info['generation']} "
            f"ms={took * 1000:.1f} collected={info['collected']} {command}\n"
        )


gc.callbacks.append(_timed)
