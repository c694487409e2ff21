"""`kvpager chat`: an interactive terminal chat, streaming each reply as it is generated.

It talks to the bundled demo model (or `--model DIR`) in-process, or to any OpenAI-compatible
server with `--url`. Commands: `/exit` (or Ctrl-D) quits, `/reset` forgets the conversation;
Ctrl-C stops the reply being written.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from kvpager.engine.args import add_engine_args, config_from_args

Message = dict[str, str]


class Backend(Protocol):
    def reply(self, messages: list[Message]) -> Iterator[str]:
        """Stream the assistant's next message as text pieces."""
        ...


class LocalBackend:
    """The engine in this process; each reply is one request, aborted if the caller stops early."""

    def __init__(self, engine: Any, params: Any) -> None:
        self.engine = engine
        self.params = params
        self._next_id = 0

    def reply(self, messages: list[Message]) -> Iterator[str]:
        text = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = self.engine.tokenizer.encode(text, add_special_tokens=False)
        self._next_id += 1
        request_id = f"chat-{self._next_id}"
        self.engine.add_request(request_id, prompt, self.params)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    yield out.outputs[0].delta_text
        finally:
            self.engine.abort_request(request_id)  # no-op when finished; frees blocks on Ctrl-C


class RemoteBackend:
    """An OpenAI-compatible server: POST /v1/chat/completions with stream=true (stdlib HTTP only)."""

    def __init__(self, url: str, model: str | None, api_key: str | None, sampling: dict[str, Any]) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.sampling = sampling
        self.model = model or self._first_model()

    def _open(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path} answered {exc.code}: {exc.read().decode(errors='replace')}") from exc
        except urllib.error.URLError as exc:
            raise RuntimeError(f"cannot reach {self.url}: {exc.reason}") from exc

    def _first_model(self) -> str:
        with self._open("/v1/models") as resp:
            return str(json.load(resp)["data"][0]["id"])

    def reply(self, messages: list[Message]) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True, **self.sampling}
        with self._open("/v1/chat/completions", body) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(payload["error"]["message"])
                for choice in payload.get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""


def chat_loop(backend: Backend, read: Callable[[str], str], write: Callable[[str], None], system: str | None) -> None:
    """Read user lines, stream replies, keep the history; returns on /exit or end of input."""
    history: list[Message] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            write("\n")
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            del history[1 if system else 0 :]
            write("(conversation reset)\n")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        pieces: list[str] = []
        try:
            for piece in backend.reply(history):
                pieces.append(piece)
                write(piece)
        except KeyboardInterrupt:
            write(" [stopped]")
        except RuntimeError as exc:  # the server refused or failed: say so and keep chatting
            write(f"\n[error: {exc}]\n")
            history.pop()
            continue
        write("\n")
        history.append({"role": "assistant", "content": "".join(pieces)})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpager chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=None, help="chat with a running OpenAI-compatible server instead")
    p.add_argument("--api-key", default=None, help="API key for --url")
    p.add_argument("--served-model-name", default=None, help="model name to ask --url for (default: its first)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--verbose", action="store_true", help="log engine start-up")
    add_engine_args(p)
    return p


def make_backend(args: argparse.Namespace) -> Backend:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.url is not None:
        return RemoteBackend(args.url, args.served_model_name, args.api_key, sampling)
    from kvpager.core.sampling_params import SamplingParams
    from kvpager.engine.engine import Engine

    return LocalBackend(Engine(config_from_args(args)), SamplingParams(**sampling))


def main(argv: list[str] | None = None) -> int:
    """Run the chat until /exit or end of input. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        backend = make_backend(args)
        write("kvpager chat — /reset to start over, /exit to quit\n")
        chat_loop(backend, input, write, args.system)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvpager chat: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
