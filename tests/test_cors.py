"""`--cors-allowed-origins`: browsers from allowed origins get CORS headers and preflight answers; others none."""

from __future__ import annotations

import aiohttp
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url

from atomesh.config import ConfigError, load_config

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 2}
APP = "https://app.example.com"


async def test_allowed_origins_get_cors_headers_and_preflights(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], cors_allowed_origins=[APP])
    url = base_url(gw)
    async with http.options(
        url + "/v1/chat/completions",
        headers={
            "Origin": APP,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    ) as r:
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == APP
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    for body in (COMPLETION, {**COMPLETION, "stream": True}, {**COMPLETION, "max_tokens": -1}):
        async with http.post(url + "/v1/completions", json=body, headers={"Origin": APP}) as r:
            await r.read()
            assert r.headers.getall("Access-Control-Allow-Origin") == [APP], (body, r.status)
    async with http.get(url + "/v1/models", headers={"Origin": APP}) as r:
        assert r.headers["Access-Control-Allow-Origin"] == APP
    # Another origin: no CORS headers, and its preflight is not answered as one.
    async with http.post(url + "/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example"}) as r:
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    async with http.options(
        url + "/v1/completions", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    ) as r:
        assert r.status != 204 and "Access-Control-Allow-Origin" not in r.headers
    # Without the flag nothing changes.
    plain = await gateway(worker_urls=[w.url])
    async with http.post(base_url(plain) + "/v1/completions", json=COMPLETION, headers={"Origin": APP}) as r:
        assert "Access-Control-Allow-Origin" not in r.headers


def test_origins_are_checked() -> None:
    assert load_config({"cors_allowed_origins": ["*", "http://localhost:3000/"]}).cors_allowed_origins == [
        "*",
        "http://localhost:3000",
    ]
    with pytest.raises(ConfigError, match="scheme://host"):
        load_config({"cors_allowed_origins": ["localhost:3000/path"]})
