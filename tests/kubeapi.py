"""A Kubernetes API server for pods, on a loopback port, for the discovery tests.

It speaks the parts of the API that list-then-watch clients use, the way the real one does:
- `GET /api/v1/pods` and `GET /api/v1/namespaces/{ns}/pods`, bearer-token auth, equality label
  selectors, paged lists (`limit` / `continue`) with the list's resourceVersion;
- `?watch=1`: a chunked stream of JSON lines (ADDED / MODIFIED / DELETED) from a resourceVersion,
  BOOKMARK events when asked, a pod that stops matching the selector sent as DELETED (and one that
  starts matching as ADDED), `timeoutSeconds`, and an ERROR event with a 410 Status for a version
  older than the compacted history;
- `GET /api/v1/namespaces/{ns}/secrets/{name}` for the Secrets a test puts in `secrets`;
- faults a test turns on: the next N requests answered 500, every open watch cut, the server
  stopped and started again on the same port (its state kept).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

Obj = dict[str, Any]


@dataclass
class _Watch:
    namespace: str | None
    selector: dict[str, str]
    queue: asyncio.Queue[Obj | None] = field(default_factory=asyncio.Queue)
    request: web.Request | None = None
    bookmarks: bool = False


def status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def flag(value: str | None) -> bool:
    """A boolean query parameter, read as the API server (Go's strconv.ParseBool) reads it."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def parse_selector(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip()
    return out


def matches(pod: Obj, namespace: str | None, selector: dict[str, str]) -> bool:
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    return (namespace is None or meta["namespace"] == namespace) and all(
        labels.get(k) == v for k, v in selector.items()
    )


class KubeApiServer:
    """Pods, their resource versions and event history, served over HTTP; see the module docstring."""

    def __init__(self, token: str = "test-token") -> None:
        self.token = token
        self.port = 0
        self.pods: dict[tuple[str, str], Obj] = {}
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}  # (namespace, name) -> data (base64 values)
        self.rv = 1000
        self.history: list[tuple[int, str, Obj, Obj | None]] = []  # (rv, type, object, previous object)
        self.compacted = 0  # watches from a version below this get 410 Gone
        self.fail_next = 0  # answer this many requests with fail_status
        self.fail_status = 500
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, query) of every request
        self._watches: list[_Watch] = []
        self._uids = itertools.count(1)
        self._snapshots: dict[str, tuple[str, list[Obj]]] = {}  # continue token -> rest of a list
        self._tokens = itertools.count(1)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ server
    async def start(self) -> KubeApiServer:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{namespace}/secrets/{name}", self._secret)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        """Stop listening and cut every open watch (the state is kept for `start()`)."""
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def drop_watches(self) -> None:
        """Cut every open watch connection, as a restarting API server or a load balancer does."""
        for w in self._watches:
            if w.request is not None and w.request.transport is not None:
                w.request.transport.abort()
            w.queue.put_nowait(None)
        self._watches.clear()

    def compact(self) -> None:
        """Forget the event history: a watch from any version before the current one gets 410 Gone."""
        self.compacted = self.rv
        self.history.clear()

    def bookmark(self) -> None:
        """Send a BOOKMARK with the current version to every watch that asked for bookmarks."""
        for w in (w for w in self._watches if w.bookmarks):
            w.queue.put_nowait(
                {
                    "type": "BOOKMARK",
                    "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}},
                }
            )

    def watch_requests(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if flag(q.get("watch"))]

    def list_requests(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if not flag(q.get("watch"))]

    # ------------------------------------------------------------------ pods
    def add_pod(
        self,
        namespace: str,
        name: str,
        ip: str | None,
        labels: dict[str, str],
        *,
        annotations: dict[str, str] | None = None,
        ready: bool = True,
        phase: str = "Running",
    ) -> Obj:
        pod: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{next(self._uids)}",
                "labels": dict(labels),
                "annotations": dict(annotations or {}),
                "managedFields": [{"manager": "kubelet", "operation": "Update"}],
            },
            "spec": {"containers": [{"name": "engine", "image": "atomesh-engine"}]},
            "status": {
                "phase": phase,
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }
        self._record("ADDED", pod, None)
        return pod

    def update_pod(
        self,
        namespace: str,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        ready: bool | None = None,
        ip: str | None = None,
        deleting: bool = False,
    ) -> Obj:
        old = self.pods[(namespace, name)]
        pod = copy.deepcopy(old)
        if labels is not None:
            pod["metadata"]["labels"] = dict(labels)
        if annotations is not None:
            pod["metadata"]["annotations"] = dict(annotations)
        if ready is not None:
            pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        if ip is not None:
            pod["status"]["podIP"] = ip
        if deleting:
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self._record("MODIFIED", pod, old)
        return pod

    def delete_pod(self, namespace: str, name: str) -> None:
        old = self.pods[(namespace, name)]
        self._record("DELETED", copy.deepcopy(old), old)

    def _record(self, kind: str, pod: Obj, old: Obj | None) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if kind == "DELETED":
            del self.pods[key]
        else:
            self.pods[key] = pod
        self.history.append((self.rv, kind, pod, old))
        del self.history[:-1000]
        for w in self._watches:
            event = self._event_for(w, kind, pod, old)
            if event is not None:
                w.queue.put_nowait(event)

    @staticmethod
    def _event_for(w: _Watch, kind: str, pod: Obj, old: Obj | None) -> Obj | None:
        now = kind != "DELETED" and matches(pod, w.namespace, w.selector)
        before = old is not None and matches(old, w.namespace, w.selector)
        if kind == "DELETED":
            return {"type": "DELETED", "object": pod} if before else None
        if now and before:
            return {"type": "MODIFIED", "object": pod}
        if now:
            return {"type": "ADDED", "object": pod}
        if before:
            return {"type": "DELETED", "object": pod}  # no longer selected
        return None

    # ------------------------------------------------------------------ handler
    async def _secret(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.query)))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        ns, name = request.match_info["namespace"], request.match_info["name"]
        data = self.secrets.get((ns, name))
        if data is None:
            return web.json_response(status(404, "NotFound", f'secrets "{name}" not found'), status=404)
        return web.json_response(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {"name": name, "namespace": ns},
                "data": data,
            }
        )

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.path, query))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response(
                status(self.fail_status, "InternalError", "etcdserver: request timed out"), status=self.fail_status
            )
        namespace = request.match_info.get("namespace")
        selector = parse_selector(query.get("labelSelector", ""))
        if flag(query.get("watch")):
            return await self._watch(request, namespace, selector, query)
        return self._list(namespace, selector, query)

    def _list(self, namespace: str | None, selector: dict[str, str], query: dict[str, str]) -> web.Response:
        token = query.get("continue")
        if token:
            snapshot = self._snapshots.pop(token, None)
            if snapshot is None:
                return web.json_response(status(410, "Expired", "the continue token expired"), status=410)
            version, items = snapshot
        else:
            version = str(self.rv)
            items = [copy.deepcopy(p) for _, p in sorted(self.pods.items()) if matches(p, namespace, selector)]
        limit = int(query.get("limit") or 0)
        page, rest = (items[:limit], items[limit:]) if limit else (items, [])
        meta: Obj = {"resourceVersion": version}
        if rest:
            meta["continue"] = f"c{next(self._tokens)}"
            self._snapshots[meta["continue"]] = (version, rest)
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page})

    async def _watch(
        self, request: web.Request, namespace: str | None, selector: dict[str, str], query: dict[str, str]
    ) -> web.StreamResponse:
        w = _Watch(namespace, selector, request=request, bookmarks=flag(query.get("allowWatchBookmarks")))
        since = query.get("resourceVersion") or "0"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if since not in ("", "0") and int(since) < self.compacted:
            gone = status(410, "Expired", f"too old resource version: {since} ({self.compacted})")
            await resp.write(orjson.dumps({"type": "ERROR", "object": gone}) + b"\n")
            await resp.write_eof()
            return resp
        if since in ("", "0"):
            backlog = [
                {"type": "ADDED", "object": p} for _, p in sorted(self.pods.items()) if matches(p, namespace, selector)
            ]
        else:
            backlog = [
                e
                for rv, kind, pod, old in self.history
                if rv > int(since)
                if (e := self._event_for(w, kind, pod, old)) is not None
            ]
        for event in backlog:
            w.queue.put_nowait(event)
        self._watches.append(w)
        timeout = float(query.get("timeoutSeconds") or 1800)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    event = await w.queue.get()
                    if event is None:
                        break
                    await resp.write(orjson.dumps(event) + b"\n")
        except TimeoutError:
            pass
        finally:
            if w in self._watches:
                self._watches.remove(w)
        try:
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return resp


def write_kubeconfig(path: Path, server: str, token: str, namespace: str = "default") -> Path:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: {server}
users:
- name: gateway
  user:
    token: {token}
contexts:
- name: test
  context:
    cluster: test
    user: gateway
    namespace: {namespace}
current-context: test
""")
    return path
