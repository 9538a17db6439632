"""Kubernetes service discovery: pods selected by their labels become workers.

`KubernetesDiscovery` keeps a copy of the selected pods with the list-then-watch protocol of the
Kubernetes API (list, then watch from the list's resourceVersion; resume a broken watch from the last
resourceVersion seen, bookmarks included; list again on 410 Gone; back off on errors) and, after every
change, reconciles the workers it owns with the pods that should be workers: a pod that is Running and
Ready, has an IP and is not being deleted becomes a worker through `Lifecycle.add` (pending -> health ->
ready, as `POST /workers`); a worker whose pod went away, stopped being ready or changed drains through
`Lifecycle.remove` (in-flight requests finish). An API error never changes the copy of the pods, so
workers stay while the API server is away. Workers added on the command line or with `POST /workers`
are never touched.

The HTTP calls go through the `kubernetes_asyncio` client (credentials from the pod's service account,
or from KUBECONFIG / ~/.kube/config); the events are read as raw JSON.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog

from atomesh.config import GatewayConfig, parse_model_id_source, parse_selector
from atomesh.workers.lifecycle import Lifecycle
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import KV_EVENTS_LABEL, Worker, WorkerRole, WorkerSource, WorkerState

log = structlog.get_logger("atomesh.discovery")


class DiscoveryError(RuntimeError):
    """Discovery cannot start (no client library, no credentials); the message says why."""


class ApiError(Exception):
    """The API server answered a list or watch with an error (`status` 0: not HTTP, e.g. a bad body)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """What discovery selects and how it talks to the API server."""

    selector: Mapping[str, str]
    prefill_selector: Mapping[str, str]
    decode_selector: Mapping[str, str]
    pd: bool
    port: int
    namespace: str | None = None
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"
    model_id_source: tuple[str, str] | None = None  # ("namespace" | "label" | "annotation", key)
    watch_timeout_secs: int = 300  # the API server ends each watch after this; it is resumed at once
    list_page_size: int = 500
    initial_backoff_secs: float = 0.25
    max_backoff_secs: float = 30.0
    resync_secs: float = 30.0  # how often failed registrations are tried again

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> DiscoverySettings:
        return cls(
            selector=parse_selector(cfg.selector),
            prefill_selector=parse_selector(cfg.prefill_selector),
            decode_selector=parse_selector(cfg.decode_selector),
            pd=cfg.pd_disaggregation,
            port=cfg.service_discovery_port,
            namespace=cfg.service_discovery_namespace,
            bootstrap_port_annotation=cfg.bootstrap_port_annotation,
            model_id_source=parse_model_id_source(cfg.model_id_from) if cfg.model_id_from else None,
        )

    def server_selector(self) -> str:
        """The labelSelector sent to the API server: the selector, or in P/D mode the labels both
        role selectors share (the roles are told apart here)."""
        if self.pd:
            chosen = [s for s in (self.prefill_selector, self.decode_selector) if s]
            common = {k: v for k, v in chosen[0].items() if all(s.get(k) == v for s in chosen[1:])} if chosen else {}
        else:
            common = dict(self.selector)
        return ",".join(f"{k}={v}" for k, v in sorted(common.items()))

    def role_of(self, labels: Mapping[str, str]) -> WorkerRole | None:
        """The role of a pod with these labels, or None when it is not selected (or matches both roles)."""

        def matches(selector: Mapping[str, str]) -> bool:
            return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

        if not self.pd:
            return WorkerRole.REGULAR if matches(self.selector) else None
        prefill, decode = matches(self.prefill_selector), matches(self.decode_selector)
        if prefill == decode:
            return None
        return WorkerRole.PREFILL if prefill else WorkerRole.DECODE


@dataclass(frozen=True, slots=True)
class Pod:
    """The fields of a pod that discovery reads."""

    uid: str
    namespace: str
    name: str
    ip: str | None
    phase: str
    ready: bool
    deleting: bool
    labels: Mapping[str, str]
    annotations: Mapping[str, str]

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Pod | None:
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid:
            return None
        conditions = status.get("conditions") or []
        ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        return cls(
            uid=uid,
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            ip=status.get("podIP") or None,
            phase=str(status.get("phase") or "Unknown"),
            ready=ready,
            deleting=meta.get("deletionTimestamp") is not None,
            labels=_str_map(meta.get("labels")),
            annotations=_str_map(meta.get("annotations")),
        )

    @property
    def serving(self) -> bool:
        """Running and Ready with an IP and not being deleted: the pod takes traffic."""
        return self.phase == "Running" and self.ready and bool(self.ip) and not self.deleting


def _str_map(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class Wanted:
    """A worker a pod should be; a registered worker that no longer equals it is replaced."""

    url: str
    role: WorkerRole
    bootstrap_port: int | None
    pod: str  # namespace/name
    uid: str
    model_id: str | None
    kv_events: str | None = None  # the pod's KV events endpoint (KV_EVENTS_ANNOTATION), for kv_aware
    api_key_secret: SecretRef | None = None  # where the worker's own key is (API_KEY_SECRET_ANNOTATION)


# A pod that publishes KV cache events says where: "tcp://*:5557[,tcp://*:5558]" ("*": the pod's IP).
KV_EVENTS_ANNOTATION = "atomesh.io/kv-events-endpoint"
# A pod whose engine wants a key of its own names the Secret holding it, "<secret>/<key>", in the pod's
# namespace (the key itself is never put in an annotation: those are readable by anyone who can list pods).
API_KEY_SECRET_ANNOTATION = "atomesh.io/api-key-secret"
SecretRef = tuple[str, str, str]  # (namespace, secret name, key in its data)


def secret_ref(pod: Pod) -> SecretRef | None:
    """The pod's API_KEY_SECRET_ANNOTATION as (namespace, secret, key); None when absent or malformed."""
    raw = pod.annotations.get(API_KEY_SECRET_ANNOTATION, "").strip()
    name, _, key = raw.partition("/")
    return (pod.namespace, name, key) if name and key and "/" not in key else None


def wanted_worker(pod: Pod, settings: DiscoverySettings) -> Wanted | None:
    """The worker a pod should be, or None when it should be none (not selected or not serving)."""
    role = settings.role_of(pod.labels)
    if role is None or not pod.serving or pod.ip is None:
        return None
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    bootstrap = bootstrap_port(pod, settings) if role is WorkerRole.PREFILL else None
    model_id = None
    if settings.model_id_source is not None:
        kind, key = settings.model_id_source
        model_id = (
            pod.namespace
            if kind == "namespace"
            else pod.labels.get(key)
            if kind == "label"
            else pod.annotations.get(key)
        ) or None
    return Wanted(
        url=f"http://{host}:{settings.port}",
        role=role,
        bootstrap_port=bootstrap,
        pod=f"{pod.namespace}/{pod.name}",
        uid=pod.uid,
        model_id=model_id,
        kv_events=pod.annotations.get(KV_EVENTS_ANNOTATION) or None,
        api_key_secret=secret_ref(pod),
    )


def bootstrap_port(pod: Pod, settings: DiscoverySettings) -> int | None:
    """The port in the pod's bootstrap-port annotation, or None (absent or not a port)."""
    raw = pod.annotations.get(settings.bootstrap_port_annotation, "").strip()
    return int(raw) if raw.isdigit() and 1 <= int(raw) <= 65535 else None


class KubernetesDiscovery:
    """Owns the watch task and the resync task; `start()` and `stop()` are called by the gateway."""

    def __init__(self, settings: DiscoverySettings, lifecycle: Lifecycle, registry: WorkerRegistry) -> None:
        self.settings = settings
        self.lifecycle = lifecycle
        self.registry = registry
        self.pods: dict[str, Pod] = {}  # uid -> pod, as last listed / watched
        self.resource_version: str | None = None
        self.synced = asyncio.Event()  # set once the first list is in
        self.lists = 0  # full lists done (the first one, then one per 410 Gone)
        self.errors = 0  # API errors met (each followed by a backoff)
        self._owned: dict[str, tuple[Worker, Wanted]] = {}  # url -> worker discovery added
        self._noted: set[str] = set()  # keys of the warnings already logged
        self._kick = asyncio.Event()
        self._events = 0  # watch events since the last attempt began
        self._api: Any = None
        self._client: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        # Workers' keys read from Secrets (None: could not be read, retried at the next resync), and reads
        # under way.
        self._keys: dict[SecretRef, str | None] = {}
        self._reading: dict[SecretRef, asyncio.Task[None]] = {}
        registry.subscribe(self._on_worker_state)

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        """Load the credentials and start watching; raises DiscoveryError when that cannot be done."""
        self._client = await _api_client()
        from kubernetes_asyncio.client import CoreV1Api

        self._api = CoreV1Api(self._client)
        s = self.settings
        log.info(
            "discovery_started",
            namespace=s.namespace or "(all)",
            selector=s.server_selector() or "(none)",
            mode="pd" if s.pd else "regular",
            port=s.port,
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch_forever(), name="discovery-watch"),
            loop.create_task(self._resync_forever(), name="discovery-resync"),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._reading.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._reading.clear()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def owned(self) -> dict[str, Worker]:
        """The workers discovery added that are still registered, by URL."""
        return {url: w for url, (w, _) in self._owned.items()}

    # ------------------------------------------------------------------ list and watch
    async def _watch_forever(self) -> None:
        backoff = self.settings.initial_backoff_secs
        gone = False  # the last attempt ended in 410 Gone
        while True:
            self._events = 0
            try:
                if self.resource_version is None:
                    await self._list()
                    backoff = self.settings.initial_backoff_secs
                if await self._watch():
                    backoff = self.settings.initial_backoff_secs
                    gone = False
                    continue
                error = "the watch ended at once without an event"
            except ApiError as e:
                if e.status == 410:
                    log.info("discovery_relist", reason="resource version too old (410 Gone)")
                    self.resource_version = None
                    if not gone or self._events:  # list again at once; a second 410 in a row backs off
                        gone = True
                        continue
                error = str(e)
                if e.status in (401, 403):
                    error += " (check the gateway's ServiceAccount and its Role: get, list and watch pods)"
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                # ValueError: a line longer than the client's buffer
                error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            gone = False
            self.errors += 1
            if self._events:
                backoff = self.settings.initial_backoff_secs  # the watch worked for a while: a fresh failure
            delay = backoff * random.uniform(0.8, 1.2)
            log.warning("discovery_api_error", error=error, retry_in_secs=round(delay, 2), known_pods=len(self.pods))
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, self.settings.max_backoff_secs)

    def _call(self, **kwargs: Any) -> Any:
        s = self.settings
        if s.namespace is not None:
            return self._api.list_namespaced_pod(s.namespace, _preload_content=False, **kwargs)
        return self._api.list_pod_for_all_namespaces(_preload_content=False, **kwargs)

    async def _list(self) -> None:
        """List the selected pods (page by page) and replace the copy with them."""
        pods: dict[str, Pod] = {}
        token: str | None = None
        selector = self.settings.server_selector()
        while True:
            kwargs: dict[str, Any] = {"limit": self.settings.list_page_size, "_request_timeout": (10, 60)}
            if selector:
                kwargs["label_selector"] = selector
            if token:
                kwargs["_continue"] = token
            resp = await self._call(**kwargs)
            try:
                body = await resp.read()
                if resp.status != 200:
                    raise _status_error(resp.status, body)
            finally:
                resp.release()
            try:
                page = orjson.loads(body)
                items = page.get("items") or []
                meta = page.get("metadata") or {}
            except (orjson.JSONDecodeError, AttributeError):
                raise ApiError(0, "the pod list is not a JSON object") from None
            for obj in items:
                pod = Pod.from_json(obj) if isinstance(obj, dict) else None
                if pod is not None:
                    pods[pod.uid] = pod
            token = meta.get("continue") or None
            if token is None:
                version = meta.get("resourceVersion")
                break
        if not version:
            raise ApiError(0, "the pod list has no resourceVersion to watch from")
        self.pods = pods
        self.resource_version = str(version)
        self.lists += 1
        log.info("discovery_listed", pods=len(pods), resource_version=self.resource_version)
        self.synced.set()
        self._kick.set()

    async def _watch(self) -> bool:
        """Follow the pod events from the last resource version until the stream ends; True if it
        carried any event or lasted a while (so it is resumed at once, without backoff)."""
        s = self.settings
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": self.resource_version,
            "timeout_seconds": s.watch_timeout_secs,
            "_request_timeout": (10, s.watch_timeout_secs + 30),
        }
        if s.server_selector():
            kwargs["label_selector"] = s.server_selector()
        started = time.monotonic()
        events = 0
        resp = await self._call(**kwargs)
        try:
            if resp.status != 200:
                raise _status_error(resp.status, await resp.read())
            while True:
                line = await resp.content.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                self._apply(line)
                events += 1
                self._events += 1
        finally:
            resp.release()
        return events > 0 or time.monotonic() - started > 1.0

    def _apply(self, line: bytes) -> None:
        try:
            event = orjson.loads(line)
            kind = event["type"]
            obj = event["object"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise ApiError(0, f"unreadable watch event {line[:200]!r}") from None
        if kind == "ERROR":
            raise ApiError(int(obj.get("code") or 0), str(obj.get("message") or obj.get("reason") or obj))
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            pod = Pod.from_json(obj)
            if pod is not None:
                if kind == "DELETED":
                    self.pods.pop(pod.uid, None)
                else:
                    self.pods[pod.uid] = pod
                self._kick.set()  # one reconcile for a burst of events
        # BOOKMARK events carry only the resource version to resume from.
        if version:
            self.resource_version = str(version)

    # ------------------------------------------------------------------ reconcile
    def reconcile(self, retry_failed: bool = False) -> None:
        """Add, replace or drain discovered workers so that they match the serving pods."""
        if retry_failed:  # Secrets that could not be read are read again
            self._keys = {ref: key for ref, key in self._keys.items() if key is not None}
        wanted: dict[str, Wanted] = {}
        for pod in self.pods.values():
            w = wanted_worker(pod, self.settings)
            if w is None or w.url in wanted:
                continue
            wanted[w.url] = w
            raw = pod.annotations.get(self.settings.bootstrap_port_annotation)
            if w.role is WorkerRole.PREFILL and raw is not None and w.bootstrap_port is None:
                self._note(
                    f"bootstrap {pod.uid}",
                    "discovery_bad_bootstrap_port",
                    pod=w.pod,
                    value=raw,
                    annotation=self.settings.bootstrap_port_annotation,
                )
        for url, (worker, was) in list(self._owned.items()):
            want = wanted.get(url)
            if worker.state is WorkerState.DRAINING:
                continue
            if want != was:
                log.info(
                    "discovery_worker_gone" if want is None else "discovery_worker_changed", worker=url, pod=was.pod
                )
                self.lifecycle.remove(worker)
            elif worker.state is WorkerState.FAILED and retry_failed:
                self._add(want)
        for url, want in wanted.items():
            if url in self._owned:
                continue
            taken = self.registry.by_url(url)
            if taken is not None:
                self._note(url, "discovery_url_taken", worker=url, pod=want.pod, source=taken.source.value)
                continue
            self._add(want)

    def _note(self, key: str, event: str, **fields: Any) -> None:
        """Log a warning once per key (reconcile runs on every event)."""
        if key not in self._noted and len(self._noted) < 10_000:
            self._noted.add(key)
            log.warning(event, **fields)

    def _add(self, want: Wanted) -> None:
        api_key = None
        ref = want.api_key_secret
        if ref is not None:
            if ref not in self._keys:
                if ref not in self._reading:  # read it, then reconcile again
                    self._reading[ref] = asyncio.get_running_loop().create_task(
                        self._read_secret(ref), name=f"discovery-secret {ref[0]}/{ref[1]}"
                    )
                return
            api_key = self._keys[ref]
            if api_key is None:
                return  # unreadable: warned once; a worker that wants a key is not added without it
        log.info("discovery_worker_found", worker=want.url, pod=want.pod, role=want.role.value)
        try:
            worker = self.lifecycle.add(
                want.url,
                want.role,
                want.bootstrap_port,
                source=WorkerSource.KUBERNETES,
                pod=want.pod,
                model_id=want.model_id,
                api_key=api_key,
                labels={KV_EVENTS_LABEL: want.kv_events} if want.kv_events else None,
            )
        except ValueError as e:
            self._note(f"add {want.url}", "discovery_worker_refused", worker=want.url, pod=want.pod, error=str(e))
            return
        self._owned[want.url] = (worker, want)

    async def _read_secret(self, ref: SecretRef) -> None:
        """Read a worker's key from its Secret (RBAC: get on secrets in the pods' namespaces)."""
        namespace, name, key = ref
        value: str | None = None
        try:
            resp = await self._api.read_namespaced_secret(
                name, namespace, _preload_content=False, _request_timeout=(10, 30)
            )
            try:
                body = await resp.read()
                if resp.status != 200:
                    raise _status_error(resp.status, body)
            finally:
                resp.release()
            data = orjson.loads(body).get("data") or {}
            if key not in data:
                raise ApiError(0, f"the secret has no key {key!r}")
            value = base64.b64decode(data[key], validate=True).decode().strip() or None
            if value is None:
                raise ApiError(0, f"the secret's {key!r} is empty")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an API error, a malformed secret: said once, retried at the next resync
            self._note(
                f"secret {namespace}/{name}/{key}",
                "discovery_secret_unreadable",
                secret=f"{namespace}/{name}",
                secret_key=key,
                error=str(e)[:300],
            )
        finally:
            self._reading.pop(ref, None)
        self._keys[ref] = value
        self._kick.set()

    def _on_worker_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if new is WorkerState.REMOVED:
            self._noted.discard(worker.url)
            owned = self._owned.get(worker.url)
            if owned is not None and owned[0] is worker:
                del self._owned[worker.url]
            if worker.source is WorkerSource.KUBERNETES or owned is None:
                self._kick.set()  # a URL was freed: a pod waiting for it can become a worker now

    async def _resync_forever(self) -> None:
        last_retry = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), self.settings.resync_secs)
            except TimeoutError:
                pass
            self._kick.clear()
            retry = time.monotonic() - last_retry >= self.settings.resync_secs
            if retry:
                last_retry = time.monotonic()
            if self.synced.is_set():
                self.reconcile(retry_failed=retry)


def _status_error(status: int, body: bytes) -> ApiError:
    try:
        message = str(orjson.loads(body).get("message") or "")
    except (orjson.JSONDecodeError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    return ApiError(status, message or f"HTTP {status}")


async def _api_client() -> Any:
    """An ApiClient with the pod's service account (in a cluster) or the kubeconfig's credentials."""
    try:
        from kubernetes_asyncio import client, config
    except ImportError:
        raise DiscoveryError(
            "--service-discovery needs the Kubernetes client: pip install 'atomesh[kubernetes]'"
        ) from None
    configuration = client.Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            path = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
            await config.load_kube_config(config_file=path, client_configuration=configuration, persist_config=False)
    except (config.ConfigException, OSError) as e:
        raise DiscoveryError(
            f"--service-discovery: no Kubernetes credentials ({e}); in a pod give it a "
            "ServiceAccount, elsewhere set KUBECONFIG or write ~/.kube/config"
        ) from None
    return client.ApiClient(configuration)
