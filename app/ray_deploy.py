"""The service on Ray Serve: each replica runs the same app as `dualread serve`.

A replica is the FastAPI app from `app.main.create_app` (same routers, schemas, error
mapping, metrics) with its own `Service` (actor + heads). Only the queue differs: Ray
Serve's `@serve.batch` forms the micro-batches (`ServeBatcher`), and Serve's proxy spreads
requests over the replicas, starts new ones when one dies, and scales between
`--replicas` and `--max-replicas` on the number of requests in flight.

Used by `dualread serve --ray`; `application()` gives the bound app for `serve.run` or a
Serve config of your own.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from app.engine import Batcher, Job
from app.main import create_app
from app.ray_proxy import PROXY_ENV
from app.service import Service
from app.settings import Settings, apply_threads

APP_NAME = "dualread"
REPLICA_HEADER = "x-dualread-replica"


class ServeBatcher(Batcher):
    """`app.engine.Batcher` with `@serve.batch` forming the batches.

    What a job goes through is the Batcher's own: admission (queue limit → 429, shutting
    down → 503), deadlines checked before a batch runs, jobs of different keys never
    sharing a model call, one model thread, one failing item failing alone, and the
    metrics hooks. `self.queue` holds the jobs that no batch has taken yet.
    """

    def start(self) -> None:
        self.pending: set[asyncio.Task] = set()
        self._batch.set_max_batch_size(self.max_batch)
        self._batch.set_batch_wait_timeout_s(self.wait)

    def submit_many(self, handler: str, payloads: Sequence[Any], deadline: float,
                    key: Any = None) -> list[Job]:
        jobs = super().submit_many(handler, payloads, deadline, key)
        loop = asyncio.get_running_loop()
        for job in jobs:
            # an empty context: the batch queue's long-lived task is created inside the
            # first of these, and must not keep that request's context for good
            task = loop.create_task(self._batch(job), context=contextvars.Context())
            self.pending.add(task)            # a reference, so the task is not collected
            task.add_done_callback(self.pending.discard)
        return jobs

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01, max_concurrent_batches=1)
    async def _batch(self, jobs: list[Job]) -> list[None]:
        """Results go to each job's future; @serve.batch only gathers the jobs, and the
        Batcher's own dispatch runs them."""
        await self._dispatch(jobs)
        return [None] * len(jobs)

    async def stop(self) -> None:
        """Refuse what no batch has taken, let running batches end, close."""
        self.refuse_queued()
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
        self.pool.shutdown(wait=False)


class ReplicaHeader:
    """Names the replica that answered, to find its logs and metrics."""

    def __init__(self, app: Any, name: str) -> None:
        self.app, self.name = app, name.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (REPLICA_HEADER.encode(), self.name)]
            await send(message)

        await self.app(scope, receive, send_named)


@serve.deployment(name="DualRead")
@serve.ingress()
class DualRead:
    def __init__(self, settings: dict[str, Any]) -> None:
        s = self.settings = Settings(**settings)
        apply_threads(s)
        # Loaded here, not in the background: Serve routes to a replica only once its
        # constructor has returned, so no request meets a model that is still loading.
        service = Service(s.actor, s.heads, s.device, s.dtype, s.heads_mismatch)
        self.api = create_app(s, service=service)
        self.api.state.serving.new_batcher = ServeBatcher
        replica = serve.get_replica_context().replica_id.unique_id
        self.api.add_middleware(ReplicaHeader, name=replica)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.api

    async def check_health(self) -> None:
        """Serve's health check is the service's readiness (GET /health/ready)."""
        serving = self.api.state.serving
        if not serving.ready:
            raise RuntimeError("shutting down" if serving.draining else
                               serving.load_error or "not ready")


def application(settings: Settings, replicas: int = 1, max_replicas: int | None = None
                ) -> Application:
    """The Serve application: `replicas` replicas, or autoscaling from `replicas` to
    `max_replicas` on requests in flight; one GPU per replica on CUDA."""
    if replicas < 1 or (max_replicas is not None and max_replicas < replicas):
        raise ValueError("need 1 <= replicas <= max_replicas")
    s = settings
    opts: dict[str, Any] = {
        # The replica's own queue answers 429 before Serve would queue at the proxy.
        "max_ongoing_requests": s.queue_limit + s.max_batch_size,
        "graceful_shutdown_wait_loop_s": 1.0,
        # in-flight jobs end by their deadline; then the app's shutdown drains the rest
        "graceful_shutdown_timeout_s": s.request_timeout_s + 5,
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "ray_actor_options": {"num_gpus": 1} if s.device.startswith("cuda") else
        {"num_cpus": 1},
    }
    if max_replicas is not None and max_replicas > replicas:
        opts["autoscaling_config"] = {
            "min_replicas": replicas, "initial_replicas": replicas,
            "max_replicas": max_replicas, "target_ongoing_requests": s.max_batch_size}
    else:
        opts["num_replicas"] = replicas
    # The API key reaches the replicas as their environment, not as a visible argument.
    if s.api_key:
        opts["ray_actor_options"]["runtime_env"] = {"env_vars": {"DUALREAD_API_KEY": s.api_key}}
    return DualRead.options(**opts).bind(s.model_dump(exclude={"api_key"}))


def deploy(settings: Settings, replicas: int = 1, max_replicas: int | None = None) -> None:
    """Start Serve's HTTP proxy on settings.host:port and run the app; returns once every
    replica is up (the Ray instance must already be connected)."""
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(application(settings, replicas, max_replicas), name=APP_NAME, route_prefix="/")


def start_ray(address: str | None = None, **init: Any) -> None:
    """Join the Ray cluster at `address`, or start a local instance whose HTTP proxy keeps
    one x-request-id (`app.ray_proxy`; on a cluster of your own, set `PROXY_ENV` on the
    head node before `ray start`)."""
    import ray

    if address is None:
        for k, v in PROXY_ENV.items():      # the local instance inherits this environment
            os.environ.setdefault(k, v)
    ray.init(address=address, **init)


def serve_forever(settings: Settings, replicas: int = 1, max_replicas: int | None = None,
                  address: str | None = None) -> None:
    """`dualread serve --ray`: start a local Ray instance (or join `address`), deploy,
    and on SIGINT/SIGTERM delete the app (replicas drain) and leave."""
    import ray

    start_ray(address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(settings, replicas, max_replicas)
        stop.wait()
    finally:
        serve.delete(APP_NAME)
        if address is None:       # our own instance: nothing else runs on it
            serve.shutdown()
        ray.shutdown()
