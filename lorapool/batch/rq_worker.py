"""RQ's worker classes, with a shutdown that does not stall for a minute.

``rq worker --worker-class lorapool.batch.rq_worker.Worker`` (compose, the manifests and
the chart pass it; ``SimpleWorker`` for a worker that runs jobs in its own process).

Why: RQ 3 runs each worker's command channel (shutdown, stop-job) in a redis-py pub/sub
thread that waits up to 60 s for a message, and relies on its UNSUBSCRIBE reply to wake it
at teardown. When the thread reads that reply before the main thread has tripped its stop
flag, it goes back to waiting (60 s, now on "not subscribed"), and redis-py 8.2's
``stop()`` joins it without a bound: a worker that finished its burst, or that a SIGTERM
told to go, sits there for up to a minute. On a loaded machine that happens (a batch test
timed out on it in CI). Here the thread waits at most ``COMMAND_POLL_S`` per turn: one
wake-up a second per worker costs nothing, and the shutdown waits at most that long.
"""

from __future__ import annotations

from rq.worker import SimpleWorker as _RQSimpleWorker
from rq.worker import Worker as _RQWorker

COMMAND_POLL_S = 1.0


class _PromptShutdown:
    def subscribe(self) -> None:
        """RQ's subscription to the worker's command channel, its thread's wait bounded."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=COMMAND_POLL_S,
            daemon=True,
            exception_handler=self._pubsub_exception_handler,
        )


class Worker(_PromptShutdown, _RQWorker):
    """RQ's forking worker (each job in a work horse)."""


class SimpleWorker(_PromptShutdown, _RQSimpleWorker):
    """RQ's worker that runs each job in its own process."""
