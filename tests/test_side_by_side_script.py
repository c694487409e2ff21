"""scripts/side_by_side.py's engine specs: a command it starts, or `@PID` for a server already running."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "side_by_side.py"


@pytest.fixture
def side_by_side(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "side_by_side", module)  # its dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def test_an_engine_is_a_command_or_an_attached_pid(side_by_side: ModuleType) -> None:
    started = side_by_side.parse_engine("kv=8101=kvpager serve --model m --port 8101")
    assert (started.name, started.port, started.attached_pid) == ("kv", 8101, None)
    assert started.command == "kvpager serve --model m --port 8101"
    attached = side_by_side.parse_engine("vllm=8202=@4321")
    assert (attached.port, attached.attached_pid) == (8202, 4321)


@pytest.mark.parametrize("text", ["kv=8101", "kv=port=cmd", "vllm=8202=@pid"])
def test_a_malformed_engine_is_refused_naming_the_forms(side_by_side: ModuleType, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=PORT=COMMAND or NAME=PORT=@PID"):
        side_by_side.parse_engine(text)


def test_an_attached_engine_is_waited_for_without_a_process(side_by_side: ModuleType) -> None:
    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = side_by_side.parse_engine(f"up={server.server_port}=@1")
        side_by_side.wait_ready(engine, None, timeout=10)  # returns once /v1/models answers 200
        with pytest.raises(SystemExit, match="not ready"):
            side_by_side.wait_ready(side_by_side.Engine("down", 1, "@1"), None, timeout=1.5)
    finally:
        server.shutdown()
