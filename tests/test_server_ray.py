"""Ray Serve on this machine: a local cluster on 127.0.0.1 (every Ray process listening there only),
two replicas of the tiny E2B loaded from an exported bundle, 32 concurrent requests over both, and a
replica killed mid-load: the requests caught on it get OpenAI's error JSON with 503 and Retry-After,
the rest succeed, and Ray restarts it from the bundle (compile_s 0). Those are marked slow: a
cluster, two replicas and a bundle take minutes here; the deployment options and the proxy's
middleware are checked without a cluster.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time

import httpx
import psutil
import pytest

QUESTION = "What is the capital of {}?"
COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "Kenya", "Peru", "Chile"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from gemma4lib.server.ray_app import RayOptions, deploy  # noqa: I001 - before ray: keeps the node on 127.0.0.1
    import ray
    from ray import serve

    from gemma4lib.export import export_bundle
    from gemma4lib.cli import load_engine_from
    from gemma4lib.port import PortSettings
    from gemma4lib.server.launch import free_port

    bundle = tmp_path_factory.mktemp("bundle") / "e2b"
    export_bundle(PortSettings(variant="e2b", profile="smoke", batch_size=4), str(bundle))
    settings = PortSettings(variant="e2b", profile="smoke", batch_size=4, artifacts=str(bundle))
    options = RayOptions(replicas=2, port=free_port(), max_queue=32)
    url = deploy(settings, options, load_engine_from, num_cpus=3)  # 2 text replicas + the one that hears
    try:
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


async def _ask(http: httpx.AsyncClient, url: str, country: str, max_tokens: int = 24) -> dict:
    body = {
        "model": "e2b",
        "messages": [{"role": "user", "content": QUESTION.format(country)}],
        "max_tokens": max_tokens,
    }
    try:
        response = await http.post(url + "/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return {"country": country, "status": None, "error": repr(exc)}
    out = {"country": country, "status": response.status_code, "replica": response.headers.get("x-gemma4lib-replica")}
    if response.status_code == 200:
        out["text"] = response.json()["choices"][0]["message"]["content"]
    else:
        out["error"] = response.text
        out["retry_after"] = response.headers.get("retry-after")
    return out


def _load(url: str, n: int, timeout_s: float = 240.0, during=None) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            tasks = [asyncio.create_task(_ask(http, url, COUNTRIES[i % len(COUNTRIES)])) for i in range(n)]
            if during is not None:
                await during()
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)

    return asyncio.run(main())


def _replica_metrics(url: str, want: int, timeout_s: float = 60.0) -> dict[str, str]:
    """Each replica's /metrics text, by replica id (the proxy picks a replica per request)."""
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        response = httpx.get(url + "/metrics", timeout=10)
        seen[response.headers["x-gemma4lib-replica"]] = response.text
    return seen


def _served(metrics: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("gemma4lib_requests_total"))


def _listeners() -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every TCP socket listening in this process and its descendants
    (the local cluster's GCS, raylet, agents, workers, replicas, Serve's proxy and controller)."""
    me = psutil.Process()
    pids = {me.pid, *(p.pid for p in me.children(recursive=True))}
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            out.append((c.pid, name, c.laddr.ip, c.laddr.port))
    return out


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.mark.slow
def test_every_ray_process_listens_on_the_loopback_only(deployment):
    import ray

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    listening = _listeners()
    names = {name for _, name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names and any("Proxy" in n for n in names), listening
    assert any("ServeRepli" in n for n in names), listening
    outside = [entry for entry in listening if not _loopback(entry[2])]
    assert not outside, f"listening beyond the loopback: {outside}"
    print(f"{len(listening)} listening sockets, all on the loopback: {sorted(names)}")


@pytest.mark.slow
def test_two_replicas_serve_32_concurrent_requests(deployment):
    results = _load(deployment, 32)
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200]
    assert all("Paris" in r["text"] for r in results if r["country"] == "France")
    texts = {}
    for r in results:  # greedy: one answer per question, whichever replica served it
        texts.setdefault(r["country"], set()).add(r["text"])
    assert all(len(v) == 1 for v in texts.values()), texts
    replicas = {r["replica"] for r in results}
    assert len(replicas) == 2, replicas
    metrics = _replica_metrics(deployment, 2)
    assert set(metrics) == replicas
    assert all(_served(text) > 0 for text in metrics.values()), metrics  # both replicas' own counters


@pytest.mark.slow
def test_a_killed_replica_is_restarted_from_the_bundle(deployment):
    import ray

    before = {}
    deadline = time.monotonic() + 60
    while len(before) < 2 and time.monotonic() < deadline:
        health = httpx.get(deployment + "/health", timeout=10).json()
        before[health["replica"]] = health
    victim = sorted(before)[0]
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + victim)]
    assert len(names) == 1, names
    actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])

    async def kill_soon():  # 64 requests keep both replicas' rows and queues busy for a few seconds
        await asyncio.sleep(0.3)
        ray.kill(actor, no_restart=True)

    results = _load(deployment, 64, during=kill_soon)
    failed = [r for r in results if r["status"] != 200]
    ok = [r for r in results if r["status"] == 200]
    assert ok, results
    assert all(r["replica"] != victim or r["status"] == 200 for r in results)
    assert failed, "no request was caught on the killed replica: the kill came too late to test it"
    for r in failed:  # caught on the killed replica: OpenAI's error JSON, 503, naming the cause, Retry-After
        assert r["status"] == 503, r
        error = json.loads(r["error"])["error"]
        assert error["code"] == "replica_unavailable" and "Ray actor died" in error["message"], r
        assert int(r["retry_after"]) >= 1, r
    # Ray Serve starts a new replica; it loads the bundle (no compile) and serves
    deadline = time.monotonic() + 180
    after = {}
    while time.monotonic() < deadline:
        try:
            health = httpx.get(deployment + "/health", timeout=10).json()
            after[health["replica"]] = health
        except (httpx.HTTPError, ValueError):
            pass
        if len(set(after) - {victim}) >= 2:
            break
        time.sleep(0.2)
    fresh = set(after) - set(before)
    assert fresh, after
    assert all(after[r]["compile_s"] == 0 for r in fresh), after
    again = _load(deployment, 8)
    assert all(r["status"] == 200 for r in again), again
    print(
        f"killed {victim}: {len(failed)} of {len(results)} requests failed ({failed[0]['status']}: "
        f"{failed[0]['error'][:200]!r}); new replica(s) {sorted(fresh)}, compile_s 0"
    )


@pytest.fixture(scope="module")
def hearing_deployment(deployment, tmp_path_factory):
    """`serve --hear` under Ray on the same local cluster: a second app, one replica of the E2B fixture that hears
    (its bundle carries the 30 s audio graph), under /hearing; deleted when the module ends (the cluster stops)."""
    from ray import serve

    from gemma4lib.cli import load_engine_from
    from gemma4lib.export import export_bundle
    from gemma4lib.port import PortSettings
    from gemma4lib.server.ray_app import RayOptions, build_app

    bundle = tmp_path_factory.mktemp("bundle") / "e2b-hears"
    export_bundle(PortSettings(variant="e2b", profile="smoke", batch_size=2, hears=True), str(bundle))
    settings = PortSettings(variant="e2b", profile="smoke", batch_size=2, hears=True, artifacts=str(bundle))
    app = build_app(settings, RayOptions(replicas=1, max_queue=8), load_engine_from)
    serve.run(app, name="hearing", route_prefix="/hearing")
    try:
        yield deployment + "/hearing"
    finally:
        serve.delete("hearing")


@pytest.mark.slow
def test_a_ray_replica_that_hears_answers_input_audio_and_transcriptions(hearing_deployment):
    """The official `openai` client against a Ray replica built with clips: an `input_audio` part (the spoken
    question, answered) and /v1/audio/transcriptions (the clip's words), as the single-process server answers."""
    import base64

    from openai import OpenAI

    from gemma4lib.models import audio

    client = OpenAI(base_url=hearing_deployment + "/v1", api_key="none", timeout=120, max_retries=0)
    wav = (audio.CLIPS_DIR / "capital_of_france.wav").read_bytes()
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    reply = client.chat.completions.create(
        model="e2b", messages=[{"role": "user", "content": [part]}], max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == "The capital of France is Paris."
    words = client.audio.transcriptions.create(model="e2b", file=("question.wav", wav)).text
    assert words == audio.shipped_text([wav]) == "What is the capital of France?"


@pytest.mark.parametrize(
    ("backend", "tp", "vision", "want"),
    [
        ("neuron", 2, False, {"neuron_cores": 2}),
        ("neuron", 2, True, {"neuron_cores": 2}),  # the vision graph beside rank 0: no core of its own
        ("neuron", 2, "hears", {"neuron_cores": 2}),  # the audio graph too (`serve --hear`): no extra core
        ("cpu", 1, False, None),
    ],
)
def test_replicas_reserve_their_cores_and_scaling_comes_from_options(backend, tp, vision, want):
    from types import SimpleNamespace

    from gemma4lib.server.ray_app import RayOptions, deployment_options, split_options

    settings = SimpleNamespace(
        backend=backend, tp_degree=tp, batch_size=4, artifacts="b", variant="e2b", wants_vision=vision is True,
        hears=vision == "hears",
    )  # fmt: skip
    fixed = deployment_options(settings, RayOptions(replicas=3, max_queue=16))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"].get("resources") == want and fixed["ray_actor_options"]["num_cpus"] == 1
    assert fixed["max_ongoing_requests"] == 4 + 16
    scaled = deployment_options(settings, RayOptions(min_replicas=1, max_replicas=4, target_ongoing_requests=6))
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 6}
    assert "num_replicas" not in scaled
    rest, options = split_options({"variant": "e2b", "artifacts": "b", "replicas": "2", "target_ongoing_requests": "3"})
    assert rest == {"variant": "e2b", "artifacts": "b"} and (options.replicas, options.target_ongoing_requests) == (
        2,
        3.0,
    )


def test_the_proxy_middleware_answers_503_when_no_response_came_and_ends_a_cut_stream():
    """Serve's proxy ends a request whose replica died without sending anything (or mid-stream): the
    middleware it is given (`ray_proxy.proxy_middlewares`) answers for it."""
    from starlette.middleware import Middleware

    from gemma4lib.server.ray_proxy import ReplicaLost, proxy_middlewares

    assert [type(m) for m in proxy_middlewares()] == [Middleware]

    async def run(app):
        sent = []

        async def send(message):
            sent.append(message)

        await ReplicaLost(app)({"type": "http", "method": "POST", "path": "/v1/chat/completions"}, None, send)
        return sent

    async def silent(scope, receive, send):  # what the proxy does after RayActorError
        return None

    async def cut(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    async def whole(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    start, body = asyncio.run(run(silent))
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"1"
    assert json.loads(body["body"])["error"]["code"] == "replica_unavailable"
    *_, last = asyncio.run(run(cut))
    assert last["body"].startswith(b"data: ") and b"replica_unavailable" in last["body"] and not last.get("more_body")
    assert len(asyncio.run(run(whole))) == 2  # a complete response passes untouched


def test_ray_replicas_need_a_bundle():
    from types import SimpleNamespace

    from gemma4lib.errors import SettingsError
    from gemma4lib.server.ray_app import RayOptions, build_app

    with pytest.raises(SettingsError, match="gemma4lib export --variant e2b"):
        build_app(SimpleNamespace(artifacts=None, variant="e2b"), RayOptions(), lambda kwargs: None)
