"""A worker process for tests: the real Worker around the benchmark's stand-in engine
(``standin``), as ``benchmarks/queue_gpu.py --serve-worker`` runs it, on either pool
layout: ``python standin_worker.py URL PREFIX SHARDS NAME SEQUENCES STEP_MS``, where URL
may name a Redis Cluster node (``redis+cluster://``) and SHARDS is the pool's shard count.
Runs until SIGTERM."""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from standin import load  # noqa: E402

from lorapool.connection import connect  # noqa: E402
from lorapool.worker import Worker, WorkerConfig  # noqa: E402


def main(url, prefix, shards, name, sequences, step_ms):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    bench = load()
    engine = bench.StandInEngine(int(sequences), float(step_ms) / 1000)
    config = WorkerConfig(
        prefix=prefix, shards=int(shards), name=name, audit_key=bench.AUDIT_KEY.encode()
    )
    Worker(engine, connect(url), config, bench.BASE_MODEL).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
