"""The gateway serves with its heap frozen out of full collections (``lorapool/heap.py``,
``GatewayServer.startup``): a hostile tenant's flood made it run one of ~35 ms every ~2 s,
each holding the event loop while other tenants' calls waited (issue 51's p99). The
server as ``lorapool serve`` runs it, in this process: frozen and the first generation's
threshold raised while it serves, both put back once it has stopped."""

from __future__ import annotations

import gc
import threading

import httpx
import uvicorn
from gateway_procs import free_port, wait_until

from lorapool import heap
from lorapool.gateway import GatewayConfig, create_app
from lorapool.gateway.server import GatewayServer


def test_the_heap_is_frozen_while_the_gateway_serves(redis_url, prefix):
    before = gc.get_threshold(), gc.get_freeze_count()
    config = GatewayConfig(redis_url=redis_url, prefix=prefix, auth=False)
    port = free_port()
    server = GatewayServer(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the in-process gateway starting", 30)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        serving = gc.get_threshold(), gc.get_freeze_count()
    finally:
        server.should_exit = True
        thread.join(timeout=15)
    assert serving[0][0] >= heap.GEN0_THRESHOLD
    assert serving[1] > 10_000  # the modules, the app: all that was alive at startup
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
