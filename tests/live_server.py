"""A real HTTP server (uvicorn on a free port) over the in-process app, on a background thread.

Used where a test needs real sockets (schemathesis, the soak) but not a separate process: the
process start-up (imports, model load) would dominate a short run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn
from server_harness import free_port


class ThreadServer:
    """`with ThreadServer(app) as url:` serves `app` (lifespan included) until the block ends."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-thread server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
