"""A real Redis/Valkey server on loopback for tests: started on a free port, stopped or killed by the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

SERVER_BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str:
    """The installed server binary; skips (with the reason) where none is installed."""
    for name in SERVER_BINARIES:
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.skip("no valkey-server or redis-server on PATH (`make system-deps` or `apt-get install redis-server`)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StoreServer:
    """One server process; `url` is what `--kv-cache-remote` takes."""

    def __init__(self, workdir: Path, port: int | None = None, maxmemory: str = "64mb") -> None:
        self.port = port if port is not None else free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", str(workdir)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the store server exited with code {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"the store server did not answer PING on port {self.port}")

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class DelayProxy:
    """A TCP proxy in front of a store that holds every reply `delay_s` before passing it on (a slow store)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        import threading

        self.delay_s = delay_s
        self.target_port = target_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = int(self._listener.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}"
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.delay_s), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        try:
            while data := source.recv(1 << 16):
                if delay_s:
                    time.sleep(delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            sock.close()
