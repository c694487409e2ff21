"""One local Ray (2 CPUs) with Ray Serve's HTTP proxy, shared by the Ray Serve test modules.

Starting Ray and Serve costs 20-30 s on 2 cores, so the modules that deploy an application share
one cluster: each deploys its application with `serve.run` and deletes it afterwards. conftest.py
stops the cluster after the last test that asked for it, so no Ray process runs beside the rest of
the suite. A module that breaks Serve (kills its controller) stops the cluster itself; a later
module then starts a fresh one. Also the helpers those modules share: the demo engine's settings,
one completion through the endpoint and the same prompt on one engine."""

from __future__ import annotations

import os
from types import ModuleType

import httpx
import pytest
from redis_server import free_port

from kvpager.api.llm import LLM
from kvpager.core.sampling_params import SamplingParams

BLOCK = 16
NUM_NEW = 4
ENGINE = {"device": "cpu", "num_threads": 1, "block_size": BLOCK, "kv_cache_memory": 64 << 20, "max_num_seqs": 8}

# NOTE: Ray Serve's default proxy ready/health deadlines (5 s / 10 s) are missed on a loaded 2-core
# machine; the local Ray processes inherit these from the environment of the test process.
RAY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


class RayCluster:
    """Starts Ray and Serve on first use; `stop` shuts both down and restores the environment."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.ray: ModuleType | None = None
        self._saved: dict[str, str | None] = {}

    def start(self) -> str:
        """The Serve endpoint's URL, starting Ray and Serve if they are not running."""
        if self.url is not None:
            return self.url
        ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvpager[ray]')")
        self._saved = {key: os.environ.get(key) for key in RAY_ENV}
        os.environ.update(RAY_ENV)
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        except Exception as error:  # noqa: BLE001
            self._restore_env()
            if "timed out during startup" in str(error):
                # NOTE: the raylet gives its Python agents a fixed ~30 s to write their port files; on
                # an overloaded machine they start later and Ray refuses to start. Not a kvpager failure.
                pytest.skip(f"Ray could not start on this machine (agent start-up deadline): {error}")
            raise
        self.ray = ray
        from ray import serve

        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self.ray is None:
            return
        from ray import serve

        try:
            serve.shutdown()
        finally:
            self.ray.shutdown()
            self.ray = None
            self.url = None
            self._restore_env()

    def _restore_env(self) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved = {}


def complete(url: str, prompt: list[int]) -> tuple[str, str, int]:
    """(text, replica, cached tokens) of a greedy completion through the endpoint."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    text = data["choices"][0]["text"]
    return text, resp.headers["x-kvpager-replica"], int(data["usage"]["prompt_tokens_details"]["cached_tokens"])


def greedy_text(llm: LLM, prompt: list[int]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def delete_app(name: str = "kvpager") -> None:
    """Deletes one Serve application, waiting until its replicas are gone."""
    from ray import serve

    serve.delete(name)
