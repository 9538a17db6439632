"""`atomesh up`: the whole system from one command, driven with the openai client."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from gwtest import free_port, require


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free (atomesh up takes consecutive engine ports)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise AssertionError("no two consecutive free ports")


def _start_up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "atomesh",
        "up",
        "--model",
        "tiny-random",
        "--port",
        str(port),
        "--metrics-port",
        str(free_port()),
        "--engine-port",
        str(free_port_pair()),
        "--log-dir",
        str(tmp_path / "logs"),
        "--startup-timeout",
        "120",
        *extra,
    ]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    return proc, port


def _wait_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"never saw {needle!r}; output:\n{''.join(seen)}")


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["pd", "plain"])
def test_up_serves_openai_clients_and_stops_on_ctrl_c(tmp_path: Path, mode: str) -> None:
    if mode == "pd":
        require("mooncake.engine", "P/D engines relay KV over Mooncake")
    extra = ["--handshake-port", str(free_port_pair())] if mode == "pd" else ["--no-pd", "--workers", "2"]
    proc, port = _start_up(tmp_path, *extra)
    try:
        out = _wait_line(proc, "Ctrl-C stops everything", 200)
        assert "ready    gateway" in out and "curl http://127.0.0.1:" in out
        assert ("prefill-0" in out and "decode-0" in out) if mode == "pd" else "worker-1" in out
        children = _children_of(proc.pid)
        assert len(children) == 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        c = client.completions.create(model="tiny-random", prompt="hello there", max_tokens=4, temperature=0)
        assert c.usage is not None and c.usage.completion_tokens == 4
        chunks = list(
            client.chat.completions.create(
                model="tiny-random", max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}]
            )
        )
        assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) >= 1
        if mode == "pd":  # the answers came through a KV transfer from prefill to decode
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/engine_metrics", timeout=10) as r:
                pulled = re.findall(rb"atom:kv_transfer_pulled_total\{[^}]*\} (\S+)", r.read())
            assert sum(float(x) for x in pulled) >= 2
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, rest
        assert "stopped" in rest
        for pid in children:  # every child is gone
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_up_refuses_busy_ports_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "atomesh",
                "up",
                "--no-pd",
                "--model",
                "tiny-random",
                "--port",
                str(port),
                "--log-dir",
                str(tmp_path / "logs"),
            ],
            capture_output=True,
            text=True,
            timeout=50,
        )
    assert proc.returncode == 1
    assert f"gateway needs {port}" in proc.stdout and "ports already in use" in proc.stdout
    assert "starting worker" not in proc.stdout


@pytest.mark.timeout(120)
def test_up_reports_a_part_that_fails_to_start(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "atomesh",
            "up",
            "--no-pd",
            "--workers",
            "1",
            "--model",
            "/no/such/model.gguf",
            "--port",
            str(free_port()),
            "--metrics-port",
            str(free_port()),
            "--engine-port",
            str(free_port()),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1
    assert "worker-0 exited" in proc.stdout and "worker-0.log" in proc.stdout


@pytest.mark.timeout(10)
def test_engines_sharing_a_gpu_each_get_their_share() -> None:
    from atomesh.up import UpSettings, plan_parts

    def shares(settings: UpSettings) -> list[str]:
        out = []
        for part in plan_parts(settings):
            if "--gpu-memory-utilization" in part.argv:
                out.append(part.argv[part.argv.index("--gpu-memory-utilization") + 1])
        return out

    assert shares(UpSettings(device="cuda", prefill=1, decode=1, gpus=1)) == ["0.425", "0.425"]
    assert shares(UpSettings(device="cuda", pd=False, workers=4, gpus=1)) == ["0.212"] * 4
    assert shares(UpSettings(device="cpu")) == []  # on CPU the pool comes from --kv-cache-memory-gb


@pytest.mark.timeout(10)
def test_engines_go_one_per_gpu_prefill_and_decode_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from atomesh.up import UpSettings, place_on_gpus, plan_parts, visible_gpus

    def placement(settings: UpSettings) -> list[tuple[str, str, str]]:
        return [(p.name, p.argv[p.argv.index("--device") + 1], p.argv[p.argv.index("--gpu-memory-utilization") + 1])
                for p in plan_parts(settings)[:-1]]  # fmt: skip

    assert placement(UpSettings(device="cuda", gpus=2)) == [
        ("prefill-0", "cuda:0", "0.850"), ("decode-0", "cuda:1", "0.850")]  # fmt: skip
    assert placement(UpSettings(device="cuda", prefill=2, decode=2, gpus=8)) == [
        ("prefill-0", "cuda:0", "0.850"), ("prefill-1", "cuda:1", "0.850"),
        ("decode-0", "cuda:4", "0.850"), ("decode-1", "cuda:5", "0.850")]  # fmt: skip
    # More engines than GPUs: never prefill and decode on one GPU; engines sharing one split it.
    assert placement(UpSettings(device="cuda", prefill=1, decode=3, gpus=2)) == [
        ("prefill-0", "cuda:0", "0.850"), ("decode-0", "cuda:1", "0.283"), ("decode-1", "cuda:1", "0.283"),
        ("decode-2", "cuda:1", "0.283")]  # fmt: skip
    assert [d for d, _ in place_on_gpus(["prefill"] * 3 + ["decode"], 4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [d for d, _ in place_on_gpus(["worker"] * 3, 2)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert placement(UpSettings(device="cuda", gpus=1))[1][1] == "cuda"  # one GPU: shared, as before
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == 2  # the engines see them as cuda:0 and cuda:1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == 0


@pytest.mark.timeout(10)
def test_engines_sharing_a_gpu_without_mps_get_a_note(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from atomesh.up import UpSettings, mps_running, plan_parts, sharing_note

    one_gpu = plan_parts(UpSettings(device="cuda", gpus=1))[:-1]
    note = sharing_note(one_gpu, mps=False)
    assert note is not None and "prefill-0, decode-0 on cuda" in note and "nvidia-cuda-mps-control -d" in note
    assert sharing_note(one_gpu, mps=True) is None
    assert sharing_note(plan_parts(UpSettings(device="cuda", gpus=2))[:-1], mps=False) is None  # one GPU each
    assert sharing_note(plan_parts(UpSettings())[:-1], mps=False) is None  # CPU engines
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    (tmp_path / "control").touch()
    assert mps_running()


def test_up_with_kv_aware_starts_engines_that_publish_kv_events() -> None:
    import json

    from atomesh.up import UpSettings, plan_parts

    for settings in (UpSettings(policy="kv_aware"), UpSettings(policy="kv_aware", pd=False, workers=2)):
        engines = plan_parts(settings)[:-1]
        configs = [json.loads(p.argv[p.argv.index("--kv-events-config") + 1]) for p in engines]
        assert all(c["enable_kv_cache_events"] and c["publisher"] == "zmq" for c in configs)
        ports = [port for p in engines for port in p.extra_ports]
        assert len(ports) == len(set(ports))  # each publisher its own ports, checked free before start
    assert all("--kv-events-config" not in p.argv for p in plan_parts(UpSettings(policy="cache_aware")))
