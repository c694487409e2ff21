"""Every error case of `kvpager serve` answers its status with an OpenAI-shaped body.

One real server for the module: API key from KVPAGER_API_KEY, a 4 KiB body limit, one running
sequence and at most one waiting request, and a checkpoint without a chat template.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from checkpoints import make_llama_checkpoint
from server_harness import ServerProcess, launch_server, metric, wait_for_metric

pytestmark = pytest.mark.slow  # a real uvicorn server


API_KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 64 << 10
MAX_MODEL_LEN = 4096  # long enough that a request can stay running for seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = make_llama_checkpoint(tmp_path_factory.mktemp("no_template"), max_position_embeddings=MAX_MODEL_LEN)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    args = ["--kv-cache-memory", "4MiB", "--max-num-seqs", "1", "--max-waiting-requests", "1"]
    args += ["--max-request-body-bytes", str(MAX_BODY), "--served-model-name", "tiny"]
    proc = launch_server(model_dir, tmp_path_factory.mktemp("logs"), *args, env={"KVPAGER_API_KEY": API_KEY})
    yield proc.wait_healthy()
    proc.stop()


def post(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH if headers is None else headers, timeout=30)


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, **kw}


def test_missing_or_wrong_api_key_is_401_and_health_stays_open(server: ServerProcess) -> None:
    assert_openai_error(post(server, "/v1/completions", completion(), headers={}), 401)
    err = assert_openai_error(
        post(server, "/v1/completions", completion(), headers={"Authorization": "Bearer nope"}), 401
    )
    assert err["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(f"{server.url}/v1/models"), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert post(server, "/v1/completions", completion()).status_code == 200


def test_unknown_model_is_404(server: ServerProcess) -> None:
    err = assert_openai_error(post(server, "/v1/completions", completion(model="gpt-5")), 404)
    assert "gpt-5" in err["message"] and err["param"] == "model"
    chat = {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}
    assert_openai_error(post(server, "/v1/chat/completions", chat), 404)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(temperature=-1), "temperature"),
        (completion(n=0), "n"),
        (completion(max_tokens="many"), "max_tokens"),
        (completion(top_p=0), "top_p"),
        (completion(repetition_penalty=0), None),
        (completion(min_tokens=10, max_tokens=4), None),
        (completion(prompt=[]), "prompt"),
        (completion(prompt=[1, 99999]), "prompt"),
        ({"model": "tiny"}, "prompt"),
    ],
)
def test_invalid_completion_parameters_are_400_not_422(
    server: ServerProcess, body: dict[str, Any], param: str | None
) -> None:
    err = assert_openai_error(post(server, "/v1/completions", body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_invalid_chat_parameters_are_400(server: ServerProcess) -> None:
    assert_openai_error(post(server, "/v1/chat/completions", {"model": "tiny", "messages": []}), 400)
    bad_logprobs = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert_openai_error(post(server, "/v1/chat/completions", bad_logprobs), 400)


def test_malformed_json_is_400(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions", content=b'{"prompt": "x",', headers={**AUTH, "Content-Type": "application/json"}
    )
    assert_openai_error(r, 400)


def test_prompt_over_the_context_limit_is_400_naming_limit_and_length(server: ServerProcess) -> None:
    err = assert_openai_error(post(server, "/v1/completions", completion(prompt=[5] * 5000)), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and "5000" in err["message"]
    err = assert_openai_error(
        post(server, "/v1/completions", completion(prompt=[5] * 10, max_tokens=MAX_MODEL_LEN)), 400
    )
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN + 10) in err["message"]


def test_chat_without_a_template_is_400_saying_how_to_fix_it(server: ServerProcess) -> None:
    err = assert_openai_error(
        post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}), 400
    )
    assert "chat template" in err["message"] and "--chat-template" in err["message"]


def test_oversized_body_is_413_declared_or_chunked(server: ServerProcess) -> None:
    big = json.dumps(completion(prompt="x" * (2 * MAX_BODY))).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    err = assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=big, headers=headers), 413)
    assert str(MAX_BODY) in err["message"]
    half = len(big) // 2
    chunked = httpx.post(f"{server.url}/v1/completions", content=iter([big[:half], big[half:]]), headers=headers)
    assert_openai_error(chunked, 413)


def test_full_waiting_queue_is_503_with_retry_after(server: ServerProcess) -> None:
    long = completion(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, stream=True)
    with httpx.Client(headers=AUTH, timeout=30) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=long) as running:
            lines = running.iter_lines()  # NOTE: keep a reference; a collected iterator closes the stream
            next(lines)  # the first request holds the single running slot
            with c.stream("POST", f"{server.url}/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # accepted: it is in the engine's waiting queue now
                r = post(server, "/v1/completions", completion())
                err = assert_openai_error(r, 503)
                assert int(r.headers["Retry-After"]) >= 1 and "retry" in err["message"]
                assert metric(server.url, "kvpager:num_requests_waiting") == 1.0
    assert wait_for_metric(server.url, "kvpager:kv_blocks_owned", 0.0) == 0.0
    assert metric(server.url, "kvpager:num_requests_waiting") == 0.0


def test_malformed_requests_do_not_affect_a_running_stream(server: ServerProcess) -> None:
    body = completion(prompt="The quick brown fox", max_tokens=24, stream=True)
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 2:
                assert_openai_error(post(server, "/v1/completions", completion(temperature=-3)), 400)
                assert_openai_error(post(server, "/v1/completions", completion(prompt=[7] * 5000)), 400)
                bad = httpx.post(
                    f"{server.url}/v1/completions", content=b"{", headers={**AUTH, "Content-Type": "application/json"}
                )
                assert_openai_error(bad, 400)
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    alone = post(server, "/v1/completions", completion(prompt="The quick brown fox", max_tokens=24)).json()
    assert text == alone["choices"][0]["text"]
    assert alone["usage"]["completion_tokens"] == 24


def test_client_leaving_a_non_streaming_request_aborts_it(server: ServerProcess) -> None:
    generated_before = metric(server.url, "kvpager:generation_tokens_total")
    body = json.dumps(completion(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True))
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        assert wait_for_metric(server.url, "kvpager:num_requests_running", 1.0) == 1.0
    assert wait_for_metric(server.url, "kvpager:kv_blocks_owned", 0.0) == 0.0
    assert metric(server.url, "kvpager:generation_tokens_total") - generated_before < MAX_MODEL_LEN - 16
