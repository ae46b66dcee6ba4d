"""A worker process whose engine stalls one step for ``STALL_S`` (a loaded CPU, a huge
prefill): the real Worker around the benchmark's stand-in engine (``standin``), 8
sequences, 50 ms steps; the step that starts while the file STALL_FILE exists removes
it and sleeps ``STALL_S`` before its work. ``python stalling_worker.py URL PREFIX SHARDS
NAME STALL_FILE``; runs until SIGTERM."""

import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from standin import load  # noqa: E402

from lorapool.connection import connect  # noqa: E402
from lorapool.worker import Worker, WorkerConfig  # noqa: E402

STALL_S = 30.0


def main(url, prefix, shards, name, stall_file):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    bench = load()

    class Stalling(bench.StandInEngine):
        def step(self):
            if os.path.exists(stall_file):
                os.remove(stall_file)
                time.sleep(STALL_S)
            return super().step()

    config = WorkerConfig(
        prefix=prefix, shards=int(shards), name=name, audit_key=bench.AUDIT_KEY.encode()
    )
    Worker(Stalling(8, 0.05), connect(url), config, bench.BASE_MODEL).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
