"""Every listening socket of an engine started with ``--host 127.0.0.1`` is on 127.0.0.1 (the HTTP port, the
KV events' PUB and replay sockets, the KV handshake), read from the kernel's own table of the process's
sockets; and a port that is taken is named in the error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from gwtest import EngineProcess, free_port, require

pytestmark = pytest.mark.timeout(120)

ENGINE = [
    sys.executable,
    "-m",
    "engine.openai_server",
    "--model",
    "tiny-random",
    "--device",
    "cpu",
    "--host",
    "127.0.0.1",
    "--num-kvcache-blocks",
    "64",
    "--torch-threads",
    "1",
]
WILDCARDS = {"0.0.0.0", "::"}


def listening(pid: int) -> dict[int, str]:
    """The TCP ports process ``pid`` listens on, and the address each is bound to."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out: dict[int, str] = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
            out[int(port, 16)] = socket.inet_ntop(family, raw)
    return out


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Any]]:
    """The module's three engine processes, started at once (each spends its seconds importing torch and the engine,
    on either core): one with KV events on wildcard endpoints, a P/D producer, and one asked for a taken port (the
    socket that holds the port is held until the module ends)."""
    events, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
    handshake = free_port()
    kv_transfer = {"kv_role": "kv_producer", "kv_connector": "mooncake", "handshake_port": handshake,
                   "memory_backend": "staged", "staging_buffer_mb": 1}  # fmt: skip
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = subprocess.Popen(
            [*ENGINE, "--server-port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started: dict[str, Any] = {
            "events": (EngineProcess("binds", [*ENGINE, "--kv-events-config", json.dumps(config)]), events, replay),
            "pd": (EngineProcess("binds-pd", [*ENGINE, "--kv-transfer-config", json.dumps(kv_transfer)]), handshake),
            "taken": (refused, port),
        }
        try:
            yield started
        finally:
            started["events"][0].stop()
            started["pd"][0].stop()
            refused.kill()
            refused.communicate()


def test_no_wildcard_bind_under_host_127_0_0_1(engines: dict[str, Any]) -> None:
    engine, events, replay = engines["events"]
    engine.wait_up()
    ports = listening(engine.proc.pid)
    assert ports == {engine.port: "127.0.0.1", events: "127.0.0.1", replay: "127.0.0.1"}, ports


def test_kv_handshake_binds_the_host_too(engines: dict[str, Any]) -> None:
    require("mooncake.engine", "the KV handshake starts a Mooncake agent")
    engine, handshake = engines["pd"]
    engine.wait_up()
    info = json.loads(urllib.request.urlopen(engine.url + "/kv_transfer_info", timeout=5).read())
    rpc_port = int(info["engine_id"].rsplit(":", 1)[1])
    ports = listening(engine.proc.pid)
    assert ports[engine.port] == ports[handshake] == "127.0.0.1", ports
    # Mooncake's own listeners (its RPC port and its handshake daemon) bind every interface: its
    # Python API takes no bind address (docs/security.md says so). Nothing else may: the ipc read desk
    # (a producer's pools exported on this host) listens on the engine's host too.
    wide = {p: a for p, a in ports.items() if p not in (engine.port, handshake, rpc_port) and a != "127.0.0.1"}
    assert rpc_port in ports and len(wide) <= 1, ports


def test_a_taken_port_is_named(engines: dict[str, Any]) -> None:
    proc, port = engines["taken"]
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 2
    want = f"cannot listen on 127.0.0.1:{port} (HTTP, --host/--server-port): Address already in use"
    assert want in stderr and "Traceback" not in stderr, stderr
