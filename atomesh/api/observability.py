"""`GET /engine_metrics`: every worker's own `/metrics`, merged, each sample labelled with its worker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from atomesh.errors import GatewayError, UpstreamStatus
from atomesh.gateway import GATEWAY, Gateway
from atomesh.workers.worker import Worker, WorkerState

WORKER_LABEL = "worker_addr"
SCRAPE_ERRORS = "mesh_engine_metrics_scrape_errors"
_SCRAPED_STATES = frozenset({WorkerState.READY, WorkerState.UNHEALTHY, WorkerState.DRAINING})


@dataclass(slots=True)
class _Family:
    type: str
    help: str
    lines: list[str] = field(default_factory=list)


class EngineMetrics:
    """Merges Prometheus text expositions of several workers into one, adding a `worker_addr` label."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}
        self.failed: dict[str, str] = {}

    def add(self, worker: str, text: str) -> None:
        """Add one worker's exposition; raises ValueError if it does not parse (nothing is added then)."""
        parsed = list(text_string_to_metric_families(text))  # parse all first: all or nothing
        addr = _escape(worker)
        for fam in parsed:
            name, type_ = _exposed(fam.name, fam.type)
            merged = self.families.setdefault(name, _Family(type_, fam.documentation))
            for s in fam.samples:
                if s.name.endswith("_created") and fam.type == "counter":
                    continue  # creation stamps are not samples of the counter in the text format
                labels = "".join(f',{k}="{_escape(v)}"' for k, v in s.labels.items() if k != WORKER_LABEL)
                merged.lines.append(f'{s.name}{{{WORKER_LABEL}="{addr}"{labels}}} {floatToGoString(s.value)}')  # type: ignore[no-untyped-call]

    def fail(self, worker: str, reason: str) -> None:
        self.failed[worker] = reason

    def render(self) -> str:
        out: list[str] = []
        for name, fam in self.families.items():
            if fam.help:
                out.append(f"# HELP {name} {_escape_help(fam.help)}")
            out.append(f"# TYPE {name} {fam.type}")
            out.extend(fam.lines)
        if self.failed:
            for worker, reason in self.failed.items():
                out.append(f"# worker {worker} skipped: {_one_line(reason)}")
            out.append(f"# HELP {SCRAPE_ERRORS} 1 for each worker whose /metrics could not be read")
            out.append(f"# TYPE {SCRAPE_ERRORS} gauge")
            out.extend(f'{SCRAPE_ERRORS}{{{WORKER_LABEL}="{_escape(w)}"}} 1' for w in self.failed)
        return "\n".join(out) + "\n"


def _exposed(name: str, type_: str) -> tuple[str, str]:
    """A parsed family's name and type as the Prometheus text format writes them (as prometheus-client does)."""
    if type_ == "counter":
        return name + "_total", type_
    if type_ == "info":
        return name + "_info", "gauge"
    return name, {"unknown": "untyped", "stateset": "gauge", "gaugehistogram": "histogram"}.get(type_, type_)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


async def _scrape(gw: Gateway, worker: Worker, timeout: float) -> str:
    status, body, ctype = await gw.upstream.call(
        "GET", worker.url + "/metrics", timeout=timeout, headers=gw.upstream.worker_headers(worker)
    )
    if status != 200:
        raise UpstreamStatus(status, body, ctype)
    return body.decode("utf-8", "replace")


async def engine_metrics(request: web.Request) -> web.Response:
    """Scrape every worker concurrently within the health-check timeout; a dead worker is reported, not fatal."""
    gw = request.app[GATEWAY]
    gw.keys.check_admin(request.headers)  # it names every worker
    workers = [w for w in gw.registry if w.state in _SCRAPED_STATES]
    timeout = gw.config.health_check_timeout_secs
    results = await asyncio.gather(*(_scrape(gw, w, timeout) for w in workers), return_exceptions=True)
    merged = EngineMetrics()
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, GatewayError):
                raise result
            merged.fail(worker.url, result.message)
            gw.metrics.engine_scrape_errors.labels(worker.url).inc()
            continue
        try:
            merged.add(worker.url, result)
        except ValueError as e:
            merged.fail(worker.url, f"unparsable /metrics: {e}")
            gw.metrics.engine_scrape_errors.labels(worker.url).inc()
    return web.Response(
        body=merged.render().encode(), headers={"Content-Type": CONTENT_TYPE_LATEST, "Cache-Control": "no-cache"}
    )


def setup(app: web.Application) -> None:
    app.router.add_get("/engine_metrics", engine_metrics)
