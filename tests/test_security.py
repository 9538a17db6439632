"""Keys, request validation, loop detection and what reaches logs and labels (docs/security.md)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, free_port, wait_for

from atomesh.logs import redact, setup_logging

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 2}
ADMIN_GETS = ("/workers", "/get_loads", "/get_server_info", "/engine_metrics")
OPEN_GETS = ("/health", "/liveness", "/readiness", "/v1/models")


async def _statuses(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    async with http.post(url + "/v1/completions", json=COMPLETION, headers=headers) as r:
        out["completions"] = r.status

    # A chunked upload is served by the other door: the same key applies.
    async def body():  # type: ignore[no-untyped-def]
        yield orjson.dumps(COMPLETION)

    chunked = {**headers, "Content-Type": "application/json"}
    async with http.post(url + "/v1/completions", data=body(), headers=chunked) as r:
        out["completions_chunked"] = r.status
    for path in ADMIN_GETS + OPEN_GETS + ("/get_model_info",):
        async with http.get(url + path, headers=headers) as r:
            out[path] = r.status
            if r.status == 401:
                err = (await r.json())["error"]
                assert err["type"] == "authentication_error" and "sekret" not in err["message"]
    async with http.post(url + "/flush_cache", headers=headers) as r:
        out["/flush_cache"] = r.status
    return out


async def test_api_key_guards_inference_and_admin(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], api_key="sekret")
    url = base_url(gw)
    anonymous = await _statuses(http, url, {})
    assert {k: v for k, v in anonymous.items() if k not in OPEN_GETS} == dict.fromkeys(
        ["completions", "completions_chunked", *ADMIN_GETS, "/get_model_info", "/flush_cache"], 401
    )
    assert all(anonymous[p] == 200 for p in OPEN_GETS)
    wrong = await _statuses(http, url, {"Authorization": "Bearer wrong"})
    assert wrong["completions"] == 401 and wrong["/workers"] == 401
    keyed = await _statuses(http, url, {"Authorization": "Bearer sekret"})
    assert 401 not in keyed.values() and keyed["completions"] == keyed["/workers"] == 200, keyed


async def test_admin_key_closes_admin_and_leaves_inference_open(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], admin_api_key="boss")
    url = base_url(gw)
    anonymous = await _statuses(http, url, {})
    assert anonymous["completions"] == anonymous["completions_chunked"] == 200 and anonymous["/get_model_info"] != 401
    assert all(anonymous[p] == 401 for p in (*ADMIN_GETS, "/flush_cache"))
    admin = await _statuses(http, url, {"Authorization": "Bearer boss"})
    assert 401 not in admin.values(), admin

    # Both keys: each opens its own routes only.
    gw2 = await gateway(worker_urls=[w.url], api_key="user", admin_api_key="boss")
    url2 = base_url(gw2)
    user = await _statuses(http, url2, {"Authorization": "Bearer user"})
    assert user["completions"] == 200 and user["/workers"] == 401
    boss = await _statuses(http, url2, {"Authorization": "Bearer boss"})
    assert boss["/workers"] == 200 and boss["completions"] == 401


# ---------------------------------------------------------------------------- validation
BAD_REQUESTS = [
    ("/v1/completions", {"model": "mock-model", "prompt": "x", "max_tokens": "abc"}, "max_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": "x", "max_tokens": True}, "max_tokens"),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5},
        "max_completion_tokens",
    ),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "mock-model", "prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": "mock-model", "prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"model": "mock-model", "prompt": [1, 2, "x"]}, "prompt"),
    ("/v1/completions", {"model": "mock-model", "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": 5, "prompt": "x"}, "model"),
    ("/v1/completions", {"model": "mock-model"}, "prompt"),
    ("/v1/chat/completions", {"model": "mock-model", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "mock-model", "messages": [{"content": "x"}]}, "messages.0.role"),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": 5}]},
        "messages.0.content",
    ),
    ("/v1/chat/completions", {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3},
        "presence_penalty",
    ),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "many"}}, "sampling_params.max_new_tokens"),
    ("/generate", {"sampling_params": {}}, "'text' or 'input_ids'"),
]


async def test_bad_fields_get_400_without_reaching_a_worker(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], cb_failure_threshold=2)
    url = base_url(gw)
    for path, body, field in BAD_REQUESTS:
        async with http.post(url + path, json=body) as r:
            assert r.status == 400, (body, await r.text())
            err = (await r.json())["error"]
            assert err["type"] == "invalid_request_error" and field in err["message"], (field, err)
    assert not [x for x in w.received if x["path"] != "/health"]
    # Unknown fields pass through untouched; valid extensions are accepted.
    body = {
        **COMPLETION,
        "my_extension": {"deep": [1, None]},
        "top_k": 20,
        "stop": ["\n"],
        "logprobs": 2,
        "temperature": None,
    }
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
    assert orjson.loads(orjson.dumps(w.received[-1]["body"]))["my_extension"] == {"deep": [1, None]}
    worker = next(iter(gw.gateway.registry))
    assert worker.breaker.state.value == "closed"


async def test_worker_4xx_and_load_shedding_never_open_a_breaker(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, fail_status=400)
    gw = await gateway(worker_urls=[w.url], cb_failure_threshold=2)
    for status in (400, 404, 422, 429):
        w.behaviour.fail_status = status
        for _ in range(4):
            async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
                assert r.status == status
    worker = next(iter(gw.gateway.registry))
    assert worker.breaker.state.value == "closed" and worker.breaker.failures == 0
    # Nor a 503 whose body says the worker is full (an engine shedding load): it is up, and is retried.
    w.behaviour.fail_status, w.behaviour.fail_code = 503, "queue_full"
    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "queue_full"
    assert worker.breaker.state.value == "closed" and worker.breaker.failures == 0
    w.behaviour.fail_code = None
    w.behaviour.fail_status = 500
    for _ in range(3):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            await r.read()
    assert worker.breaker.state.value == "open"  # 5xx still count


# ---------------------------------------------------------------------------- loops and URLs
async def test_gateway_refuses_to_register_itself(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], worker_startup_timeout_secs=30)
    url = base_url(gw)
    async with http.post(url + "/workers", json={"url": url}) as r:
        assert r.status == 202
        wid = (await r.json())["worker_id"]

    async def info() -> dict:  # type: ignore[type-arg]
        async with http.get(url + "/workers/" + wid) as r:
            return await r.json()  # type: ignore[no-any-return]

    state: dict = {}  # type: ignore[type-arg]

    async def failed() -> bool:
        state.update(await info())
        return state["state"] == "failed"

    deadline = asyncio.get_running_loop().time() + 5  # far less than the 30 s startup timeout
    while not await failed():
        assert asyncio.get_running_loop().time() < deadline, state
        await asyncio.sleep(0.05)
    assert "this gateway itself" in state["error"]
    # A request carrying our own hop mark is refused at once, on every route.
    hop = {"x-atomesh-gateway": gw.gateway.instance_id}
    async with http.post(url + "/v1/completions", json=COMPLETION, headers=hop) as r:
        assert r.status == 508 and (await r.json())["error"]["code"] == "loop_detected"
    async with http.get(url + "/health", headers=hop) as r:
        assert r.status == 508
    # Workers see the mark (another gateway in front of this one would be fine: its mark differs).
    async with http.post(url + "/v1/completions", json=COMPLETION, headers={"x-atomesh-gateway": "other"}) as r:
        assert r.status == 200
    assert w.received[-1]["headers"]["x-atomesh-gateway"] == gw.gateway.instance_id


async def test_worker_urls_are_bounded_and_carry_no_credentials(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    url = base_url(gw)
    long_url = "http://127.0.0.1:9/" + "a" * 2100
    async with http.post(url + "/workers", json={"url": long_url}) as r:
        assert r.status == 400 and "2048 bytes" in (await r.json())["error"]["message"]
    async with http.post(url + "/workers", json={"url": "http://bob:hunter2@127.0.0.1:9"}) as r:
        text = await r.text()
        assert r.status == 400 and "hunter2" not in text and "credentials" in text


# ---------------------------------------------------------------------------- logs
def test_redact_removes_every_credential_form() -> None:
    cases = [
        "b'Authorization: Bearer sk-live-1\\x01'",
        "<CIMultiDict('Authorization': 'Bearer sk-live-1', 'Cookie': 'session=sk-live-1')>",
        '{"event": "x", "headers": "authorization: Basic sk-live-1"}',
        "worker=http://bob:sk-live-1@host:8000/v1",
        "proxy-authorization=sk-live-1",
        "{'x-api-key': b'sk-live-1'}",
        "Set-Cookie: id=sk-live-1; Path=/",
        "token Bearer sk-live-1 in text",
    ]
    for text in cases:
        assert "sk-live-1" not in redact(text), text


async def test_no_secret_or_locals_in_logs(mock_workers: MakeWorkers, tmp_path: Path) -> None:
    """A real gateway process logging to a file (console and JSON) under malformed and failing requests."""
    [w] = await mock_workers(1)
    for json_log in (False, True):
        port, metrics_port = free_port(), free_port()
        log_dir = tmp_path / f"logs-{json_log}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "atomesh",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--worker-urls",
            w.url,
            "--log-dir",
            str(log_dir),
            "--log-level",
            "debug",
            "--worker-startup-check-interval",
            "0.1",
            "--api-key",
            "sk-live-key",
            "--shutdown-grace-period-secs",
            "1",
            *(["--json-log"] if json_log else []),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        log_file = log_dir / "atomesh.log"
        try:
            await wait_for(
                lambda f=log_file: f.exists() and "gateway_ready" in f.read_text(),
                20,  # type: ignore[misc]
                "ready",
            )
            secret = "Bearer sk-live-key"
            heads = [
                # Malformed heads carrying credentials, on both doors.
                f"GET /health HTTP/1.1\r\nAuthorization: {secret}\r\nX-Bad: a\x01b\r\n\r\n",
                f"GET /health HTTP/1.1\r\nHost: gw\r\nAuthorization: {secret}\x01\r\n\r\n",
                "POST /workers HTTP/1.1\r\nHost: gw\r\nCookie: s=sk-live-key\x7f\r\n\r\n",
                f"POST /v1/completions HTTP/1.1\r\nAuthorization: {secret}\r\nCookie: s=sk-live-key\r\n"
                "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
                f"POST /v1/completions HTTP/1.1\r\nAuthorization: {secret}\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            ]
            for head in heads:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head.encode("latin-1"))
                await writer.drain()
                await asyncio.wait_for(reader.read(), 10)
                writer.close()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                w.behaviour.fail_status = 500
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION, headers={"Authorization": secret}
                ) as r:
                    await r.read()
                w.behaviour.fail_status = None
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 15)
        text = log_file.read_text()
        assert "sk-live-key" not in text
        assert "locals" not in text.lower() and "│" not in text  # no rich frames with variables


def test_console_tracebacks_show_no_locals(tmp_path: Path) -> None:
    setup_logging("info", json=False, log_dir=tmp_path)
    try:

        def crash(token: str) -> None:
            raise RuntimeError("boom")

        try:
            crash("-".join(("sk", "local", "variable")))  # the value appears in no source line
        except RuntimeError:
            logging.getLogger("atomesh.test").exception("crashed")
        for h in logging.getLogger().handlers:
            h.flush()
        text = (tmp_path / "atomesh.log").read_text()
        assert "RuntimeError: boom" in text and "sk-local-variable" not in text
    finally:
        setup_logging("info")
