"""The engine's server live on a free loopback port, uvicorn on a thread of the test's process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from engine import EngineConfig
from engine.serving import server as srv


@contextlib.contextmanager
def live(pair, cfg: EngineConfig, **kw) -> Iterator[str]:
    """``create_app(pair, cfg, "tiny", **kw)`` served until the block ends; yields its base URL."""
    app = srv.create_app(pair, cfg, "tiny", **kw)
    sock = srv._bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
