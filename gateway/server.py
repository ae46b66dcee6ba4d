"""uvicorn, with a shutdown that ends the job-events streams first."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

GRACE_S = 5  # open OpenAI streams get this long to finish after SIGTERM


class GatewayServer(uvicorn.Server):
    """On SIGTERM or SIGINT, first end every job-events stream cleanly (an EventSource
    reconnects, with Last-Event-ID, to another gateway), then uvicorn's own shutdown:
    no new connections, open requests get ``GRACE_S`` seconds."""

    def handle_exit(self, sig, frame) -> None:
        begin = getattr(self.config.app.state, "begin_shutdown", None)
        if begin is not None:
            begin()
        super().handle_exit(sig, frame)


def run(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S
    )
    GatewayServer(config).run()
