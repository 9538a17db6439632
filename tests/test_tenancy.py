"""SMG's priority scheduler and tenant flags: classes served in order with aging, tenants clamped to
their class, per-tenant rate limits, tenant API keys; their YAML files checked at start-up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, wait_for

from atomesh.admission import Admission
from atomesh.config import ConfigError, load_config
from atomesh.tenancy import DEFAULT_CLASSES, ClassSettings, PriorityClass

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 2}


async def test_waiting_requests_are_served_by_class_then_priority_with_aging(
    tmp_path: Path, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, latency_secs=0.2)
    config = tmp_path / "scheduler.yaml"
    config.write_text(
        "classes:\n  bulk: {starvation_threshold_secs: 1.5}\ntenant_policies:\n  'header:free': {max_class: bulk}\n"
    )
    gw = await gateway(
        worker_urls=[w.url],
        max_concurrent_requests=1,
        priority_scheduler_enabled=True,
        priority_scheduler_config=config,
        priority_scheduler_default_max_class="system",
        trust_tenant_header=True,
    )
    url = base_url(gw) + "/v1/completions"
    admission = gw.gateway.admission

    async def send(name: str, headers: dict[str, str], priority: int = 0) -> int:
        async with http.post(url, json={**COMPLETION, "prompt": name, "priority": priority}, headers=headers) as r:
            return r.status

    async def queue(*requests: tuple[str, dict[str, str], int]) -> list[asyncio.Task[int]]:
        tasks = [asyncio.ensure_future(send("busy", {}))]
        await wait_for(lambda: w.active == 1, what="the slot taken")
        for i, (name, headers, priority) in enumerate(requests):
            tasks.append(asyncio.ensure_future(send(name, headers, priority)))
            await wait_for(lambda n=i + 1: admission.waiting == n, what=f"{name} queued")
        return tasks

    free = {"X-SMG-Priority": "system", "x-smg-tenant-id": "free"}
    tasks = await queue(
        ("bulk", {"X-SMG-Priority": "bulk"}, 0),
        ("default-late", {}, 5),
        ("default-early", {}, -5),
        ("clamped", free, 0),
        ("interactive", {"X-SMG-Priority": "interactive"}, 0),
    )
    assert await asyncio.gather(*tasks) == [200] * 6
    order = [x["body"]["prompt"] for x in w.received if x["path"] == "/v1/completions"][-6:]
    # interactive first, then default by the body's priority (lower first), then bulk in arrival order
    # (the tenant "free" is clamped to bulk although it asked for system).
    assert order == ["busy", "interactive", "default-early", "default-late", "bulk", "clamped"], order
    # Aging: a bulk request that waited past its class's threshold goes before a newer interactive one.
    w.behaviour.latency_secs = 2.0  # the slot stays taken past the bulk class's 1.5 s threshold
    tasks = await queue(("old-bulk", {"X-SMG-Priority": "bulk"}, 0))
    w.behaviour.latency_secs = 0.2
    await asyncio.sleep(1.6)
    tasks.append(asyncio.ensure_future(send("new-interactive", {"X-SMG-Priority": "interactive"})))
    await wait_for(lambda: admission.waiting == 2, what="both queued")
    assert await asyncio.gather(*tasks) == [200] * 3
    order = [x["body"]["prompt"] for x in w.received if x["path"] == "/v1/completions"][-3:]
    assert order == ["busy", "old-bulk", "new-interactive"], order


async def test_tenant_rate_limits_and_tenant_keys(
    tmp_path: Path, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    limits = tmp_path / "limits.yaml"
    limits.write_text(
        "default_policy: {tokens_per_minute: 1000000, requests_per_minute: 1000}\n"
        "tenants:\n"
        "  - {tenant_key: 'auth:team-red', tokens_per_minute: 1000000, requests_per_minute: 3}\n"
        "  - {tenant_key: 'header:small', tokens_per_minute: 100, requests_per_minute: 1000}\n"
    )
    gw = await gateway(
        worker_urls=[w.url],
        api_key="main-key",
        tenant_api_key=["team-red:red-key"],
        tenant_rate_limit_enabled=True,
        tenant_rate_limit_config=limits,
        trust_tenant_header=True,
    )
    url = base_url(gw) + "/v1/completions"

    async def status(headers: dict[str, str], body: dict[str, object] = COMPLETION) -> tuple[int, str]:
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, (await r.json()).get("error", {}).get("code", "")

    red = {"Authorization": "Bearer red-key"}
    assert [await status(red) for _ in range(4)] == [(200, "")] * 3 + [(429, "tenant_rate_limited")]
    main = {"Authorization": "Bearer main-key"}
    assert [await status(main) for _ in range(4)] == [(200, "")] * 4  # another tenant: its own buckets
    assert await status({"Authorization": "Bearer wrong"}) == (401, "invalid_api_key")
    # Tokens: a request estimated above what is left waits for the bucket (prompt chars / 4 + max_tokens).
    small = {**main, "x-smg-tenant-id": "small"}
    assert await status(small, {**COMPLETION, "max_tokens": 60}) == (200, "")
    assert await status(small, {**COMPLETION, "max_tokens": 60}) == (429, "tenant_rate_limited")


async def test_reserved_slots_are_kept_for_the_higher_classes() -> None:
    classes = {**DEFAULT_CLASSES, PriorityClass.INTERACTIVE: ClassSettings(256, 30, 5, reserved_per_slot=0.5)}
    admission = Admission(2, 100, 60, None, classes=classes)
    first = admission.permit(PriorityClass.BULK)
    await first.__aenter__()
    second = asyncio.ensure_future(admission.permit(PriorityClass.BULK).__aenter__())
    await asyncio.sleep(0.05)
    assert not second.done() and admission.running == 1  # the last slot is interactive's
    high = admission.permit(PriorityClass.INTERACTIVE)
    await asyncio.wait_for(high.__aenter__(), 1)
    assert admission.running == 2
    await first.__aexit__(None, None, None)
    await asyncio.wait_for(second, 1)  # a bulk request gets the slot a bulk one freed
    assert admission.running == 2


def test_scheduler_and_rate_limit_files_are_checked_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes:\n  interactive: {can_preempt: true}\n")
    for settings, needle in (
        ({"tenant_rate_limit_enabled": True}, "needs --tenant-rate-limit-config"),
        ({"priority_scheduler_enabled": True, "priority_scheduler_config": bad}, "preemption is not built"),
        ({"priority_scheduler_default_max_class": "urgent"}, "not a priority class"),
        ({"tenant_api_key": ["no-colon"]}, "TENANT_ID:KEY"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(settings)


@pytest.mark.timeout(110)
def test_bench_priority_runs_and_reports_both_gateways(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "priority.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway.priority",
            "--seconds",
            "1",
            "--tenant-seconds",
            "2",
            "--concurrency",
            "4",
            # A faster mock worker and a smaller rate limit: the bursts that empty the tenants' buckets and the
            # overload's queue drain in a few seconds rather than twenty (same phases, same report).
            "--latency-secs",
            "0.025",
            "--tenant-rpm",
            "120",
            "--tenant-demand",
            "10",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [c["gateway"] for c in report["classes"]] == ["atomesh-priority", "atomesh-fifo"]
    assert [t["tenant"] for t in report["tenants"]] == ["heavy", "light"]
    assert "atomesh-fifo" in proc.stdout and "within 10%" in proc.stdout
