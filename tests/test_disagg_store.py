"""Prefill/decode split on top of a shared KV store: a decode server pulls a prompt's blocks from the store.

A real Redis/Valkey on loopback and two real `kvpager serve` processes, a prefill server and a decode
server, both with the same `--kv-cache-remote`. A prompt the prefill server has served is in the store,
so the decode server loads its blocks from there (no HTTP fetch, the prefill server exports nothing)
and computes only the last partial block; a prompt not in the store goes over HTTP as before; once
the store is killed, the decode server still fetches over HTTP. Greedy text always equals one cold
engine's (prefix caching off).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoints import random_ids
from redis_server import StoreServer
from server_harness import ServerProcess, launch_server, metric
from test_disagg import BLOCK, KEY, MAX_TOKENS, SERVER_ARGS, complete, expected_cached

from kvpager.api.llm import LLM
from kvpager.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # a store, a prefill and a decode server


@pytest.fixture(scope="module")
def pair(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("disagg_store")
    store = StoreServer(logs)
    remote = ("--kv-cache-remote", store.url, "--kv-cache-remote-timeout", "0.5")
    prefill = launch_server(llama_checkpoint, logs, *SERVER_ARGS, *remote, "--api-key", KEY, "--role", "prefill")
    decode = launch_server(
        llama_checkpoint, logs, *SERVER_ARGS, *remote, "--role", "decode", "--prefill-url", prefill.url + "/v1",
        "--prefill-api-key", KEY, "--prefill-timeout", "10",
    )  # fmt: skip
    try:
        prefill.wait_healthy(timeout=300)  # NOTE: two servers start at once on a busy machine
        decode.wait_healthy(timeout=300)
        yield {"store": store, "prefill": prefill, "decode": decode}
    finally:
        for proc in (prefill, decode):
            proc.stop()
        store.stop()


def want(reference: LLM, prompt: list[int]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def counters(decode: ServerProcess, prefill: ServerProcess) -> dict[str, float]:
    return {
        "http": metric(decode.url, "kvpager:kv_fetches_ok_total"),
        "store": metric(decode.url, "kvpager:kv_fetches_from_store_total"),
        "failed": metric(decode.url, "kvpager:kv_fetches_failed_total"),
        "remote_hits": metric(decode.url, "kvpager:kv_remote_hits_total"),
        "exported": metric(prefill.url, "kvpager:kv_exported_blocks_total"),
    }


def wait_published(server: ServerProcess, at_least: float, timeout_s: float = 20.0) -> None:
    """Until the server's publisher has written `at_least` blocks into the store."""
    deadline = time.monotonic() + timeout_s
    while metric(server.url, "kvpager:kv_remote_published_total") < at_least:
        assert time.monotonic() < deadline, "the prefill server never wrote its blocks to the store"
        time.sleep(0.05)


def test_decode_server_pulls_stored_prompts_from_the_store_and_the_rest_over_http(
    pair: dict, llama_checkpoint: Path
) -> None:
    reference = LLM(str(llama_checkpoint), block_size=BLOCK, device="cpu", enable_prefix_caching=False)
    decode, prefill = pair["decode"], pair["prefill"]

    fresh = random_ids(45, 21)  # in no store yet: the prefill server computes it, the KV comes over HTTP
    before = counters(decode, prefill)
    got = complete(decode, fresh)
    assert got["choices"][0]["text"] == want(reference, fresh)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached(len(fresh))
    after = counters(decode, prefill)
    assert (after["http"], after["store"]) == (before["http"] + 1, before["store"])

    stored = random_ids(37, 22)  # served by the prefill server first: its blocks are in the store
    published = metric(prefill.url, "kvpager:kv_remote_published_total")
    assert complete(prefill, stored, KEY)["choices"][0]["text"] == want(reference, stored)
    wait_published(prefill, published + len(stored) // BLOCK)
    before = counters(decode, prefill)
    got = complete(decode, stored)
    assert got["choices"][0]["text"] == want(reference, stored)
    # NOTE: the decode side computed only the last partial block; every reusable block came from the store.
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached(len(stored))
    after = counters(decode, prefill)
    assert after["store"] == before["store"] + 1 and after["http"] == before["http"]
    assert after["exported"] == before["exported"], "the prefill server was not asked"
    assert after["remote_hits"] >= before["remote_hits"] + expected_cached(len(stored)) // BLOCK

    pair["store"].kill()  # the store is gone: the lookup fails fast, the KV comes over HTTP
    gone = random_ids(29, 23)
    got = complete(decode, gone)
    assert got["choices"][0]["text"] == want(reference, gone)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached(len(gone))
    after = counters(decode, prefill)
    assert after["http"] == before["http"] + 1 and after["failed"] == 0
    assert "prefixes are recomputed" in decode.log()
