"""Child processes of the benchmarks: free loopback ports, start with a log file, stop the whole group."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path

# Listening ports come from below the kernel's ephemeral range (Linux: 32768-60999) and above
# Mooncake's RPC ports (15000-17000). A port the kernel hands out for `bind(0)` is also one it may
# give a moment later to an outgoing connection as its source port, and then the server meant to
# start there cannot listen ("Address already in use"), which a loaded machine hit.
_PORTS = range(20000, 32000)
_rng = random.Random()
# Ports handed out lately: a run asks for several before its servers bind any of them, and two
# equal draws would have the second server fail to listen.
_given: deque[int] = deque(maxlen=1024)


def free_port() -> int:
    """A loopback port nothing listens on now, and not handed out lately, for a server about to be started."""
    for _ in range(200):
        port = _rng.randrange(_PORTS.start, _PORTS.stop)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _given.append(port)
            return port
    with socket.socket() as s:  # the range is crowded: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smg_launch() -> list[str] | None:
    """``smg launch`` (the pinned SMG on PATH or beside this interpreter), or None when it is not installed."""
    bindir = os.path.dirname(sys.executable)
    exe = shutil.which("smg") or (os.path.join(bindir, "smg") if os.path.exists(os.path.join(bindir, "smg")) else None)
    return [exe, "launch"] if exe else None


def loopback_flags(port: int, mport: int, policy: str = "round_robin") -> list[str]:
    """The flags every benchmark gives either gateway (atomesh or SMG): loopback ports, quiet logs, ``policy``."""
    return ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(mport), "--log-level", "warn", "--policy", policy, "--worker-startup-check-interval", "1"]  # fmt: skip


def gateway_argv(port: int, worker_url: str, *extra: str) -> list[str]:
    """``atomesh launch`` on loopback ``port`` in front of one worker, round robin, quiet logs and no access log:
    the gateway a benchmark compares with itself under ``extra`` flags."""
    return [sys.executable, "-m", "atomesh", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--worker-urls", worker_url, "--policy", "round_robin",
            "--log-level", "warn", "--access-log-sample-rate", "0", *extra]  # fmt: skip


def start(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own process group, stdout and stderr to `log` (with `env` and in `cwd`, else ours)."""
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd)


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_serving(url: str, model: str, seconds: float) -> None:
    """Wait until ``url`` answers a one-token completion for ``model``; exits the benchmark when it never does."""
    deadline = time.monotonic() + seconds
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not start serving")
