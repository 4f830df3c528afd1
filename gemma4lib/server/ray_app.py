"""The same endpoint as a Ray Serve deployment: N replicas, each an engine loaded from an exported bundle.

Ray Serve is the scale-out layer the anchors use on inf2 (its native `neuron_cores` resource sets
`NEURON_RT_VISIBLE_CORES` per replica). A replica reserves its TP degree in NeuronCores on inf2, one
CPU otherwise; it loads `--artifacts` (never compiles: a replica Ray restarts serves again in
seconds) and serves `app.py`'s FastAPI app through `serve.ingress`. Autoscaling is the caller's
(`--min-replicas/--max-replicas/--target-ongoing-requests`), else a fixed `--replicas`. Everything
binds 127.0.0.1 unless told otherwise (`start_ray`, `loopback_replica_grpc`), and a replica that dies
mid-request is a 503 in OpenAI's shape, not a bare 500 (`ray_proxy`).

`serve run` works too (an app builder in `gemma4lib.cli` taking PortSettings' and RayOptions' names)::

    serve run gemma4lib.cli:ray_app variant=e2b artifacts=bundles/e2b replicas=2 batch_size=4
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

# Ray on Linux turns a node IP of 127.0.0.1 into the host's reachable address (so that other machines
# could join), and then its gRPC servers, agents and metrics exporters listen on every interface. Its
# own variable RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 says "this machine only": 127.0.0.1 stays the node
# IP. Ray reads it when it is imported, so it is set here, before `import ray`, unless the caller set
# it (export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 to join a cluster spanning other machines).
LOCAL_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
os.environ.setdefault(LOCAL_CLUSTER_ENV, "0")

from ray import serve  # noqa: E402

from ..backends.facts import facts as backend_facts  # noqa: E402
from ..errors import SettingsError  # noqa: E402
from .launch import LOOPBACK, Loaded, build_served, favour_the_engine_thread  # noqa: E402
from .ray_proxy import CALLBACK, CALLBACK_ENV  # noqa: E402

log = logging.getLogger("gemma4lib.server")
APP_NAME = "gemma4lib"
Loader = Callable[[dict[str, Any]], Loaded]  # PortSettings' values -> an engine (gemma4lib.cli.load_engine_from)


@dataclass
class RayOptions:
    """How many replicas and how Ray scales them (fixed `replicas` unless min/max are given)."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_queue: int = 64
    model_name: str | None = None
    admit_wait_ms: float = 0.0
    host: str = LOOPBACK
    port: int = 8000
    address: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> RayOptions:
        names = {f.name for f in fields(cls)} - {"address"}
        return cls(
            **{n: getattr(args, n) for n in names if getattr(args, n, None) is not None},
            address=getattr(args, "ray_address", None),
        )

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        if self.min_replicas is None and self.max_replicas is None and self.target_ongoing_requests is None:
            return None
        low = self.min_replicas if self.min_replicas is not None else 1
        config: dict[str, Any] = {"min_replicas": low, "max_replicas": max(low, self.max_replicas or low)}
        if self.target_ongoing_requests is not None:
            config["target_ongoing_requests"] = self.target_ongoing_requests
        return config


def settings_kwargs(settings: Any) -> dict[str, Any]:
    """A `PortSettings` as the plain values a replica rebuilds it from (and checks again there)."""
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


def replica_resources(settings: Any) -> dict[str, Any]:
    """What one replica reserves: its TP degree in NeuronCores on inf2, images and clips or not (the vision and the
    `serve --hear` audio graphs sit on rank 0's core, `neuron_vision.vision_core`: no extra core, their bytes in its
    plan), so every replica's TP group starts on a chip boundary; one CPU elsewhere."""
    if backend_facts(settings.backend).device_bound:  # inf2-only
        return {"num_cpus": 1, "resources": {"neuron_cores": int(settings.tp_degree)}}
    return {"num_cpus": 1}


def deployment_options(settings: Any, options: RayOptions) -> dict[str, Any]:
    config: dict[str, Any] = {
        "ray_actor_options": replica_resources(settings),
        # beyond a replica's rows + queue its own 429 answers; Ray routes to the least loaded replica first
        "max_ongoing_requests": settings.batch_size + options.max_queue,
        "health_check_period_s": 2,
        "graceful_shutdown_timeout_s": 60,
    }
    if options.autoscaling is not None:
        config["autoscaling_config"] = options.autoscaling
    else:
        config["num_replicas"] = options.replicas
    return config


def require_bundle(settings: Any) -> None:
    if not settings.artifacts:
        raise SettingsError(
            "serve --ray deploys replicas from an exported bundle, so that no replica compiles: run "
            f"`python -m gemma4lib export --variant {settings.variant} --out bundles/{settings.variant}` (with the "
            f"same flags), then `serve --ray --artifacts bundles/{settings.variant}`"
        )


@serve.ingress()
class GemmaReplica:
    """One replica: an engine from the bundle, its scheduler thread, the FastAPI app over them."""

    def __init__(
        self, kwargs: dict[str, Any], loader: Loader, max_queue: int, model_name: str | None, admit_wait_s: float = 0.0
    ):
        import torch

        loopback_replica_grpc()
        favour_the_engine_thread()  # the replica's process is the server's: the same GIL contention
        torch.set_num_threads(int(os.environ.get("GEMMA4LIB_THREADS", "1")))
        replica = serve.get_replica_context().replica_id.unique_id
        loaded = loader(kwargs)
        info = {"load_s": round(loaded.load_s, 3), "compile_s": round(loaded.compile_s, 3), "pid": os.getpid()}
        self.served = build_served(
            loaded.engine,
            loaded.tokenizer,
            model_name=model_name or loaded.model_name,
            eos_ids=loaded.eos_ids,
            aliases=loaded.aliases,
            max_queue=max_queue,
            replica=replica,
            info=info,
            admit_wait_s=admit_wait_s,
            processor=loaded.processor,
            image_token_id=loaded.image_token_id,
        )
        log.warning("replica %s ready: load %.1f s, compile %.1f s", replica, loaded.load_s, loaded.compile_s)

    def __serve_build_asgi_app__(self) -> Any:
        from .app import create_app

        return create_app(self.served)

    def check_health(self) -> None:
        """Ray restarts a replica whose scheduler thread died (its engine can no longer generate)."""
        if not self.served.scheduler.alive:
            raise RuntimeError("the scheduler thread is gone")

    def __del__(self) -> None:  # Serve stopping the replica: finish what it started
        served = getattr(self, "served", None)
        if served is not None:
            served.scheduler.drain(60)
            served.scheduler.close()


def build_app(settings: Any, options: RayOptions, loader: Loader) -> Any:
    """The Serve application (not yet running): `serve.run(build_app(...))` deploys it. `loader` is
    pickled by reference, so it must be a module-level function (e.g. `gemma4lib.cli.load_engine_from`)."""
    require_bundle(settings)
    deployment = serve.deployment(GemmaReplica, name=APP_NAME, **deployment_options(settings, options))
    return deployment.bind(
        settings_kwargs(settings), loader, options.max_queue, options.model_name, options.admit_wait_ms / 1000.0
    )


def split_options(args: dict[str, str]) -> tuple[dict[str, str], RayOptions]:
    """`serve run`'s key=value arguments: RayOptions' names (typed here), the rest PortSettings'."""
    args = dict(args)
    typed: dict[str, Any] = {}
    for f in fields(RayOptions):
        if f.name in args:
            value = args.pop(f.name)
            floats = ("target_ongoing_requests", "admit_wait_ms")
            kind = float if f.name in floats else {"model_name": str, "host": str, "address": str}.get(f.name, int)
            typed[f.name] = kind(value)
    return args, RayOptions(**typed)


def loopback_replica_grpc() -> bool:
    """Bind this replica's inter-deployment gRPC server to 127.0.0.1 when the node IP is the loopback.

    The one listener Ray has no option for: Ray Serve 2.60 starts it on `[::]:0`, every interface
    (`ray/serve/_private/replica.py`, `add_port_to_grpc_server`), and Serve's router reaches it at the
    node IP. This wraps that private name in the replica's process before Serve starts the server;
    False (and a warning) when Ray's code no longer has it."""
    import ray
    from ray.serve._private import replica as serve_replica  # private: no public option exists

    if ray.util.get_node_ip_address() != LOOPBACK:
        return False
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "gemma4lib_loopback", False):
        if original is None:
            log.warning("Ray Serve changed: its replica gRPC server may listen on every interface")
        return original is not None

    def on_loopback(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{LOOPBACK}:{address[5:]}"
        return original(server, address)

    on_loopback.gemma4lib_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = on_loopback
    return True


def start_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join `address`, or start a local cluster whose node IP is the loopback (nothing listens outside).

    Serve's HTTP proxy gets `ray_proxy`'s callback through the environment its processes inherit (a
    cluster of your own needs `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` exported before `ray start`)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault(CALLBACK_ENV, CALLBACK)
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    ray.init(
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        dashboard_host=LOOPBACK,
        num_cpus=num_cpus,
        logging_level=logging.WARNING,
    )
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise SettingsError(
            f"Ray started its node on {node_ip}, not {LOOPBACK}: Ray was imported before gemma4lib could set "
            f"{LOCAL_CLUSTER_ENV}=0; export it before Python starts (or import gemma4lib.server.ray_app first)"
        )


def deploy(settings: Any, options: RayOptions, loader: Loader, num_cpus: int | None = None) -> str:
    """Start (or join) Ray and Serve, deploy the replicas, wait until every one is running; the URL."""
    require_bundle(settings)
    start_ray(options.address, num_cpus)
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(build_app(settings, options, loader), name=APP_NAME, route_prefix="/")
    return f"http://{options.host}:{options.port}"


def stop_ray() -> None:
    """Shut Serve down (each replica drains first) and leave the Ray cluster (a local one stops)."""
    import ray

    serve.shutdown()
    ray.shutdown()


def run_ray(settings: Any, options: RayOptions, loader: Loader) -> int:
    """`serve --ray`: deploy, then wait for SIGTERM/SIGINT and shut Serve down (replicas drain first)."""

    url = deploy(settings, options, loader)
    log.warning("Ray Serve: %s on %s/v1", APP_NAME, url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        time.sleep(0.2)
    log.warning("shutting down Ray Serve (replicas finish their requests first)")
    stop_ray()
    return 0
