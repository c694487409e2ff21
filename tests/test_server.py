"""`kvpager serve` end to end: a real server process driven by the official `openai` client.

Greedy results are compared with the offline `LLM.generate` on the same checkpoint (the server's
continuous batching must not change a single token). One server process serves the whole module.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import CJK_TEXT, ServerProcess, launch_server, make_cjk_checkpoint, metric, wait_for_metric

from kvpager.api.llm import LLM
from kvpager.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # a real uvicorn server


KV_MEMORY = 4 << 20
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_cjk_checkpoint(tmp_path_factory.mktemp("cjk_llama"))


@pytest.fixture(scope="module")
def launched(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = launch_server(
        model_dir,
        tmp_path_factory.mktemp("server_logs"),
        "--kv-cache-memory",
        "4MiB",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-num-seqs",
        "64",
        "--served-model-name",
        "tiny",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def server(launched: ServerProcess, llm: LLM) -> ServerProcess:
    # NOTE: asks for `llm` so the offline engine loads while the server process boots.
    return launched.wait_healthy()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), kv_cache_memory=KV_MEMORY, block_size=BLOCK_SIZE, device="cpu")


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def test_greedy_completion_equals_offline_generate(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "The quick brown fox"
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    want = llm.generate(prompt, greedy(12), use_tqdm=False)[0]
    assert resp.choices[0].text == want.outputs[0].text
    assert resp.choices[0].finish_reason == want.outputs[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids) == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_greedy_chat_equals_offline_chat(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    want = llm.chat(messages, greedy(10))
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want.outputs[0].text
    assert resp.usage is not None and resp.usage.prompt_tokens == len(want.prompt_token_ids)


def test_max_completion_tokens_bounds_chat_output(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3, temperature=0
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


def test_streamed_completion_concatenates_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "prompt": "Prefill writes the state", "max_tokens": 10, "temperature": 0}
    full = client.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_stream_is_sse_ending_with_done(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_streamed_chat_equals_non_streamed_chat(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 8, "temperature": 0}
    full = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_n_seeded_samples_are_reproducible_and_distinct(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "prompt": "She sells", "max_tokens": 8, "temperature": 1.0, "n": 3}
    first = client.completions.create(**kw, seed=7)  # type: ignore[call-overload]
    again = client.completions.create(**kw, seed=7)  # type: ignore[call-overload]
    other = client.completions.create(**kw, seed=8)  # type: ignore[call-overload]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "the n samples of one seeded request must differ"
    assert first.usage is not None and first.usage.completion_tokens == 24


def test_stop_string_ends_the_output_before_it(client: openai.OpenAI, llm: LLM) -> None:
    # The CJK model cycles through CJK_TEXT, so the output up to the stop string is known exactly.
    resp = client.completions.create(model="tiny", prompt=CJK_TEXT, max_tokens=30, temperature=0, stop=["字"])
    assert resp.choices[0].text == "你界文"
    assert resp.choices[0].finish_reason == "stop"
    want = llm.generate(CJK_TEXT, greedy(30, stop=["字"]), use_tqdm=False)[0]
    assert want.outputs[0].text == resp.choices[0].text


def test_completion_logprobs_match_offline(client: openai.OpenAI, llm: LLM) -> None:
    resp = client.completions.create(model="tiny", prompt="Hello, world!", max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    want = llm.generate("Hello, world!", greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs == pytest.approx([p.logprob for p in want.logprobs or []], abs=1e-4)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_list_each_token_with_its_top_alternatives(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 2
        # Greedy: the sampled token is the most likely one.
        assert token.logprob == pytest.approx(max(t.logprob for t in token.top_logprobs), abs=1e-5)


def test_usage_reports_cached_tokens_on_a_repeated_prefix(client: openai.OpenAI) -> None:
    prompt = "Identical prefixes map to identical block hashes, which gives prefix caching. " * 2
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    n = first.usage.prompt_tokens
    assert n > 2 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_token_id_prompts_and_prompt_lists_each_get_choices(client: openai.OpenAI, llm: LLM) -> None:
    prompts = [[1, 40, 41, 42], [1, 50, 51]]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0)
    want = llm.generate(prompts, greedy(5), use_tqdm=False)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [w.outputs[0].text for w in want]
    assert resp.usage is not None and resp.usage.prompt_tokens == 7


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt="Numbers:", max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="Numbers:", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Numbers:" + plain.choices[0].text


def test_streaming_chinese_never_breaks_a_character(client: openai.OpenAI, llm: LLM) -> None:
    kw = {"model": "tiny", "prompt": CJK_TEXT, "max_tokens": 3 * 8, "temperature": 0}
    deltas = [c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices]  # type: ignore[call-overload]
    full = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    assert full == (CJK_TEXT * 2)[:8]
    assert "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)
    assert full == llm.generate(CJK_TEXT, greedy(24), use_tqdm=False)[0].outputs[0].text


def test_32_concurrent_streaming_clients_get_their_own_greedy_text(server: ServerProcess, llm: LLM) -> None:
    prompts = [f"Request number {i} says hello" for i in range(32)]
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy(8), use_tqdm=False)]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as aclient:
            return list(await asyncio.gather(*(one(aclient, p) for p in prompts)))

    assert asyncio.run(run()) == want
    assert wait_for_metric(server.url, "kvpager:kv_blocks_owned", 0.0) == 0.0
    assert metric(server.url, "kvpager:num_requests_running") == 0.0


def test_client_killed_mid_stream_frees_its_blocks_at_once(server: ServerProcess) -> None:
    generated_before = metric(server.url, "kvpager:generation_tokens_total")
    body = json.dumps(
        {"model": "tiny", "prompt": "Memory management", "max_tokens": 200, "ignore_eos": True, "stream": True}
    )
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    sock.sendall(request.encode())
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    assert metric(server.url, "kvpager:kv_blocks_owned") > 0
    # Reset the connection, as the kernel does when a client process is killed.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    started = time.monotonic()
    assert wait_for_metric(server.url, "kvpager:kv_blocks_owned", 0.0) == 0.0
    assert time.monotonic() - started < 5.0
    assert metric(server.url, "kvpager:num_requests_running") == 0.0
    assert metric(server.url, "kvpager:generation_tokens_total") - generated_before < 200


def test_models_health_tokenize_and_detokenize(server: ServerProcess) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{server.url}/health").status_code == 200
    tok = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": "Hello"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    detok = httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": tok["tokens"][1:]}).json()
    assert detok["prompt"] == "Hello"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tok["count"]


def test_metrics_expose_the_vllm_style_names(server: ServerProcess, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "kvpager:num_requests_running",
        "kvpager:num_requests_waiting",
        "kvpager:kv_cache_usage_perc",
        "kvpager:kv_blocks_owned",
        "kvpager:prefix_cache_queries_total",
        "kvpager:prefix_cache_hits_total",
        "kvpager:num_preemptions_total",
        "kvpager:prompt_tokens_total",
        "kvpager:generation_tokens_total",
        "kvpager:time_to_first_token_seconds_bucket",
        "kvpager:time_per_output_token_seconds_bucket",
        "kvpager:e2e_request_latency_seconds_count",
    ):
        assert f"\n{name}{{" in text, name
    assert metric(server.url, "kvpager:e2e_request_latency_seconds_count") >= 1
    assert metric(server.url, "kvpager:generation_tokens_total") >= 3


def test_chat_cli_streams_replies_from_a_server(
    server: ServerProcess, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpager.cli import chat

    lines = iter(["Hello, world!", "/reset", "Hello, world!", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(lines))
    assert chat.main(["--url", server.url, "--temperature", "0", "--max-tokens", "6"]) == 0
    want = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello, world!"}], max_tokens=6, temperature=0
    )
    out = capsys.readouterr().out
    # After /reset the same question gets the same greedy answer again.
    assert out.count(f"{want.choices[0].message.content}\n") >= 2 and "(conversation reset)" in out


def test_chat_in_process_backend_matches_offline_chat(llm: LLM) -> None:
    from kvpager.cli.chat import LocalBackend, chat_loop

    lines = iter(["Hi there", "/exit"])
    written: list[str] = []
    chat_loop(LocalBackend(llm.engine, greedy(6)), lambda _p: next(lines), written.append, system=None)
    want = llm.chat([{"role": "user", "content": "Hi there"}], greedy(6))
    assert "".join(written) == want.outputs[0].text + "\n"
    assert llm.engine.stats().num_owned_blocks == 0


@pytest.mark.parametrize("loop", ["auto", "asyncio"])
def test_bench_serve_drives_the_server_and_reports_its_numbers(
    server: ServerProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path, loop: str
) -> None:
    from kvpager.bench import serve as bench_serve

    generated_before = metric(server.url, "kvpager:generation_tokens_total")
    argv = ["--url", server.url, "--concurrency", "4", "--num-prompts", "8", "--input-len", "16", "--output-len", "8"]
    out_file = tmp_path / "results" / "serve.json"
    assert bench_serve.main([*argv, "--vocab-size", "384", "--loop", loop, "--json", "--json-out", str(out_file)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == result
    assert result["num_failed"] == 0 and result["num_prompts"] == 8
    assert result["output_throughput"] == pytest.approx(8 * 8 / result["duration_s"])
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert result["tpot_mean_ms"] > 0
    # 8 requests of exactly 8 tokens (ignore_eos) plus the 2-token probe.
    assert metric(server.url, "kvpager:generation_tokens_total") - generated_before == 8 * 8 + 2


def test_build_server_freezes_the_startup_heap_and_starts_the_engine(llama_checkpoint: Path) -> None:
    """`kvpager serve` keeps what it built at start out of the GC's full collections."""
    import gc

    from kvpager.cli.serve import build_parser, build_server, config_from_args, settings_from_args

    args = build_parser().parse_args(["--model", str(llama_checkpoint), "--kv-cache-memory", "1MiB"])
    gc.unfreeze()
    try:
        async_engine, app = build_server(args, config_from_args(args), settings_from_args(args))
        try:
            assert async_engine.is_running
            assert gc.get_freeze_count() > 0
            assert app.title == "kvpager"
        finally:
            async_engine.shutdown()
    finally:
        gc.unfreeze()
