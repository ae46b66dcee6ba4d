"""A worker process for tests: the real Worker around the benchmark's stand-in engine
(``standin``), as ``benchmarks/queue_gpu.py --serve-worker`` runs it, on either pool
layout: ``python standin_worker.py URL PREFIX SHARDS NAME SEQUENCES STEP_MS [LEASE_S]``,
where URL may name a Redis Cluster node (``redis+cluster://``), SHARDS is the pool's
shard count and LEASE_S the worker's lease (default: WorkerConfig's). Runs until
SIGTERM."""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from standin import load  # noqa: E402

from lorapool.connection import connect  # noqa: E402
from lorapool.worker import Worker, WorkerConfig  # noqa: E402


def main(url, prefix, shards, name, sequences, step_ms, lease_s=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    bench = load()
    engine = bench.StandInEngine(int(sequences), float(step_ms) / 1000)
    lease = {} if lease_s is None else {"lease_s": float(lease_s)}
    config = WorkerConfig(
        prefix=prefix, shards=int(shards), name=name, audit_key=bench.AUDIT_KEY.encode(), **lease
    )
    Worker(engine, connect(url), config, bench.BASE_MODEL).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
