"""`kvpager serve --replicas N`: the engine deployment, its router and the ingress on Ray Serve.

Ray is optional (`pip install 'kvpager[ray]'`). With `RAY_ADDRESS` set the app joins that cluster
(replicas then spread over its machines); otherwise a local Ray instance is started. The same
application is what `serve run` would deploy: `build_application(...)` returns the bound app.

`prefill_replicas=M` (`--prefill-replicas M`) adds a prefill deployment of M replicas to the same
application: the N replicas become decode replicas that fetch each prompt's KV from it through a Ray
Serve handle (`prefill_pool.py`), KV-aware routed like the ingress's requests.

Routers (`--replica-router`): `kv-aware` (the device prefix match, balanced against queue length;
`policy.py`), `kv-aware-store` (the device match beyond what the shared store holds, then queue
length: opt-in, see docs/scale-out.md for when it loses) and `power-of-two` (Ray Serve's default).
"""

from __future__ import annotations

from typing import Any

from kvpager.api.server.app import ServerSettings
from kvpager.api.server.disagg import DEFAULT_PREFILL_TIMEOUT_S
from kvpager.core.config import EngineConfig

RAY_MISSING = "--replicas needs Ray Serve, which is not installed: pip install 'kvpager[ray]'"
ROUTING_STATS_PERIOD_S = 0.5
ENGINE_DEPLOYMENT = "KVPagerEngine"
ROUTERS = ("kv-aware", "kv-aware-store", "power-of-two")
INGRESS_DEPLOYMENT = "KVPagerIngress"


def require_ray() -> None:
    """ValueError with the install command when Ray Serve cannot be imported."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as error:
        raise ValueError(RAY_MISSING) from error


def request_router_kwargs(router: str, max_imbalance: int) -> dict[str, Any]:
    """`KVAwareRequestRouter.initialize_state`'s arguments for `--replica-router` `router` (the kv-aware ones)."""
    return {"max_imbalance": max_imbalance, "store_aware": router == "kv-aware-store"}


def build_application(
    config: EngineConfig,
    settings: ServerSettings,
    num_replicas: int,
    *,
    max_waiting: int | None = None,
    cpus_per_replica: float = 1.0,
    max_imbalance: int = 4,
    routing_stats_period_s: float = ROUTING_STATS_PERIOD_S,
    router: str = "kv-aware",
    prefill_replicas: int = 0,
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
) -> Any:
    """The bound Ray Serve application: an ingress in front of `num_replicas` engine replicas.

    With `prefill_replicas` > 0 those are decode replicas, and a prefill deployment of
    `prefill_replicas` replicas (same engine config) computes the prompts' KV for them.
    """
    if num_replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
    if cpus_per_replica <= 0:
        raise ValueError(f"--cpus-per-replica must be > 0, got {cpus_per_replica}")
    if prefill_replicas < 0:
        raise ValueError(f"--prefill-replicas must be >= 0, got {prefill_replicas}")
    pools = None
    if prefill_replicas:
        from kvpager.api.replicas.prefill_pool import pool_settings

        pools = pool_settings(settings, prefill_timeout_s)  # NOTE: validated before Ray is touched
    if router not in ROUTERS:
        raise ValueError(f"--replica-router must be one of {', '.join(ROUTERS)}; got {router!r}")
    require_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvpager.api.replicas.deployment import EngineReplica, Ingress
    from kvpager.api.replicas.router import KVAwareRequestRouter
    from kvpager.engine.paths import resolve_model_dir

    router_kwargs = request_router_kwargs(router, max_imbalance)
    store_aware = router_kwargs["store_aware"]  # NOTE: the replicas report the store's hashes only then
    router_config: dict[str, Any] = {
        "request_router_class": KVAwareRequestRouter,
        "request_router_kwargs": router_kwargs,
        "request_routing_stats_period_s": routing_stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 4 * routing_stats_period_s),
    }
    if router == "power-of-two":  # NOTE: Ray Serve's default router (the baseline for benchmarks)
        router_config = {"request_routing_stats_period_s": routing_stats_period_s}
    deployment: Any = serve.deployment

    def engine_deployment(name: str, count: int) -> Any:
        return deployment(
            EngineReplica,
            name=name,
            num_replicas=count,
            max_ongoing_requests=max(config.max_num_seqs, 1) + (max_waiting or 256),
            ray_actor_options={"num_cpus": cpus_per_replica},
            request_router_config=RequestRouterConfig(**router_config),
            health_check_period_s=2.0,
        )

    ingress = deployment(Ingress, name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=4096)
    ingress = ingress.options(ray_actor_options={"num_cpus": 0})
    tokenizer_dir = str(config.tokenizer or resolve_model_dir(config.model))
    engine = engine_deployment(ENGINE_DEPLOYMENT, num_replicas)
    if pools is None:
        return ingress.bind(
            engine.bind(config, settings, max_waiting, report_store_blocks=store_aware),
            num_replicas,
            tokenizer_dir,
            settings.chat_template,
        )
    from kvpager.api.replicas.prefill_pool import PREFILL_DEPLOYMENT

    prefill_settings, decode_settings = pools
    prefill = engine_deployment(PREFILL_DEPLOYMENT, prefill_replicas).bind(
        config, prefill_settings, max_waiting, report_store_blocks=store_aware
    )
    decode = engine.bind(config, decode_settings, max_waiting, prefill, report_store_blocks=store_aware)
    return ingress.bind(decode, num_replicas, tokenizer_dir, settings.chat_template, prefill, prefill_replicas)


def serve_replicas(
    config: EngineConfig, settings: ServerSettings, num_replicas: int, host: str, port: int, **options: Any
) -> int:
    """Start (or join) Ray, deploy the app on http://HOST:PORT and block until interrupted."""
    app = build_application(config, settings, num_replicas, **options)
    import ray
    from ray import serve

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="kvpager", route_prefix="/", blocking=True)
    return 0
