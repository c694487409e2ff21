"""Helpers for the server tests: a real `kvpager serve` subprocess, /metrics reads, a CJK checkpoint.

The CJK checkpoint is the tiny random Llama of checkpoints.py with one change: the 18 byte tokens
of `CJK_TEXT` get large embeddings and matching lm_head rows, so after any of them greedy decoding
follows the cycle through those bytes. The model therefore writes Chinese one byte-token at a
time, and each character spans three tokens: the case where a streaming server can break text.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from checkpoints import make_llama_checkpoint
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
# Six characters whose 18 UTF-8 bytes are all distinct, so "next byte" is a function of the byte.
CJK_TEXT = "你界文字页这"


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 120.0) -> ServerProcess:
        """Poll /health until 200; raises with the server log if it exits or never gets there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_server(model_dir: Path, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """Start `python -m kvpager serve` on a free port; `wait_healthy` before using it."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvpager", "serve", "--model", str(model_dir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--device", "cpu", "--num-threads", "1", "--log-level", "warning", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def metric(url: str, name: str) -> float:
    """The value of an unlabelled-or-single-series metric from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"metric {name} not in /metrics:\n{text}")
    return float(m.group(1))


def wait_for_metric(url: str, name: str, want: float, timeout: float = 5.0) -> float:
    """Poll /metrics until `name` equals `want`; returns the last value seen."""
    deadline = time.monotonic() + timeout
    value = metric(url, name)
    while value != want and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metric(url, name)
    return value


def make_cjk_checkpoint(path: Path) -> Path:
    """A tiny random Llama whose greedy continuation after a byte of CJK_TEXT cycles through CJK_TEXT."""
    from kvpager.text.tokenizer import Tokenizer

    make_llama_checkpoint(path)
    ids = Tokenizer.from_dir(path).encode(CJK_TEXT, add_special_tokens=False)
    assert len(ids) == len(CJK_TEXT.encode()) == len(set(ids)), "each CJK byte must be its own token"
    weights = load_file(str(path / "model.safetensors"))
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    gen = torch.Generator().manual_seed(0)
    for i, token_id in enumerate(ids):
        e = torch.randn(emb.shape[1], generator=gen)
        emb[token_id] = e
        # After the final norm h ~ e, so this row scores ~10 while every other row scores ~0 +- 1.
        head[ids[(i + 1) % len(ids)]] = 10.0 * e / e.dot(e)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def cjk_token_ids(path: Path) -> list[int]:
    from kvpager.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(path).encode(CJK_TEXT, add_special_tokens=False)
