"""The service on a local Ray Serve instance (CPU): two replicas of a tiny actor.

Checks that a replica answers exactly what the single-box app answers (same core, same
errors), that both replicas take traffic, and that killing one mid-load loses no request
of a client that retries.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed: pip install -e '.[dev]'")
serve = pytest.importorskip("ray.serve", reason="ray is installed without Serve: "
                                                "pip install 'ray[serve]'")

from clients.http import RETRY_STATUS, DualReadClient  # noqa: E402
from tests.conftest import random_image  # noqa: E402
from tests.helpers import b64, png_bytes, random_heads  # noqa: E402

Q = "what color is the shape?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(actor folder, heads folder): a tiny random Qwen3-VL and random heads for it."""
    from models.loading import load_actor
    from models.tiny import build_tiny_actor

    root = tmp_path_factory.mktemp("ray")
    actor = str(build_tiny_actor("qwen3_vl", root / "actor"))
    return actor, random_heads(root / "heads", load_actor(actor))


@pytest.fixture(scope="module")
def cluster(tiny):
    """A local Ray instance with the app deployed on two replicas; always shut down."""
    from app.ray_deploy import deploy, start_ray
    from app.settings import Settings

    actor, heads = tiny
    settings = Settings(actor=actor, heads=heads, port=_free_port(), max_new_tokens=8,
                        max_batch_size=4, batch_wait_ms=20, request_timeout_s=60)
    # Logical CPUs, not cores: two 1-CPU replicas plus the one that replaces a killed
    # replica must be placeable on a 2-core machine.
    start_ray(num_cpus=4, include_dashboard=False, log_to_driver=False,
              object_store_memory=100 * 1024 * 1024)
    try:
        deploy(settings, replicas=2)
        yield f"http://127.0.0.1:{settings.port}", settings
    finally:
        serve.shutdown()
        ray.shutdown()


def _local_app(settings):
    """The single-box app (`dualread serve`) on the same actor and heads, in process."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.service import Service

    svc = Service(settings.actor, settings.heads)
    return TestClient(create_app(settings, service=svc))


def test_a_replica_answers_like_the_single_box_service(cluster):
    url, settings = cluster
    image = png_bytes(random_image(3))
    body = {"image": b64(image), "question": Q}
    bad = {"image": "not base64!", "question": Q}
    with _local_app(settings) as local:
        want = local.post("/answer", json=body)
        want_bad = local.post("/answer", json=bad)
    got = httpx.post(url + "/answer", json=body, timeout=120)
    got_bad = httpx.post(url + "/answer", json=bad, timeout=120)

    assert want.status_code == got.status_code == 200
    a, b = want.json(), got.json()
    assert a.keys() == b.keys()
    assert b["answer"] == a["answer"] and b["response"] == a["response"]
    assert b["defer"] == a["defer"] and b["model"] == a["model"] and b["heads"] == a["heads"]
    for k, v in a["confidence"].items():
        assert b["confidence"][k] == pytest.approx(v, abs=1e-5), k
    assert got.headers["x-dualread-replica"]
    # the same error, from the same mapping
    assert want_bad.status_code == got_bad.status_code == 422
    assert got_bad.json()["detail"] == want_bad.json()["detail"]
    # one x-request-id, the service's (Serve's proxy would add its own)
    assert got_bad.headers.get_list("x-request-id") == [got_bad.json()["request_id"]]
    assert httpx.get(url + "/health/ready", timeout=60).json() == {"status": "ready"}


def _replica_actor(unique_id: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA") and a["name"].endswith(unique_id):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(unique_id)


def test_two_replicas_share_load_and_a_killed_one_loses_no_request(cluster):
    url, _ = cluster
    images = [png_bytes(random_image(i)) for i in range(6)]
    n_threads, per_thread = 4, 8
    seen: list[str] = []                 # replica of every 200, in arrival order
    statuses: list[int] = []             # every response, retried ones included
    lock = threading.Lock()
    results: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []
    killed: list[str] = []

    def record(response: httpx.Response) -> None:
        with lock:
            statuses.append(response.status_code)
            if response.status_code == 200:
                seen.append(response.headers.get("x-dualread-replica", ""))

    def worker(t: int) -> None:
        with DualReadClient(url, timeout=120, retries=8, backoff_base=0.5) as client:
            client.http.event_hooks["response"] = [record]
            for k in range(per_thread):
                try:
                    results[t, k] = client.answer(images[(t + k) % len(images)], Q)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,), daemon=True)
               for t in range(n_threads)]
    for th in threads:
        th.start()
    # Kill one replica once both have answered, within the first half of the load, while
    # the clients keep sending.
    total = n_threads * per_thread
    at_kill = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not killed:
        with lock:
            replicas, at_kill = set(seen), len(seen)
        if at_kill > total // 2:
            break
        if len(replicas) >= 2:
            victim = seen[at_kill - 1]
            ray.kill(_replica_actor(victim), no_restart=True)
            killed.append(victim)
        time.sleep(0.02)
    for th in threads:
        th.join(240)

    assert not any(th.is_alive() for th in threads), "clients did not finish"
    assert not errors, errors[:3]
    assert killed, f"both replicas never answered in the first half: {seen}"
    assert len(set(seen[:at_kill])) == 2 and killed[0] in seen[:at_kill]
    assert len(results) == total                         # every request answered
    assert all(0 <= r.confidence.dualread <= 1 for r in results.values())
    assert len(seen) == total                            # one 200 per request
    # what the kill did to requests in flight: only statuses the client retries (a 408,
    # with Retry-After, when Serve re-routed a request to a replica that could no longer
    # read its body)
    assert set(statuses) <= {200, 408, *RETRY_STATUS}, sorted(set(statuses))
    with pytest.raises((LookupError, ValueError, ray.exceptions.RayActorError)):
        ray.get(_replica_actor(killed[0]).__ray_ready__.remote(), timeout=30)


def test_application_options_replicas_autoscaling_and_gpus():
    """The deployment options Serve receives (no Ray instance needed)."""
    from app.ray_deploy import application
    from app.settings import Settings

    def config(app):
        d = app._bound_deployment
        return d._deployment_config, d.ray_actor_options, d.init_args

    cfg, actor, args = config(application(Settings(queue_limit=32, max_batch_size=4), 3))
    assert cfg.num_replicas == 3 and cfg.autoscaling_config is None
    assert cfg.max_ongoing_requests == 32 + 4 and actor["num_cpus"] == 1
    cfg, actor, args = config(application(Settings(device="cuda", api_key="k"), 2, 5))
    auto = cfg.autoscaling_config
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (2, 2, 5)
    assert actor["num_gpus"] == 1
    assert actor["runtime_env"]["env_vars"] == {"DUALREAD_API_KEY": "k"}
    assert "api_key" not in args[0]          # never a visible deployment argument
    with pytest.raises(ValueError):
        application(Settings(), 3, 2)
