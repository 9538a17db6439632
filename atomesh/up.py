"""`atomesh up`: a whole local system in one command.

Starts engine workers (one prefill and one decode by default, each `python -m engine.openai_server`)
and a gateway in front of them (`atomesh launch --pd-disaggregation --backend atom`), shows each part
coming up, prints how to use it, and on Ctrl-C stops everything, children included. A part that
fails to start stops the rest and says why and where its log is. atomesh and the engine meet only
over HTTP (and Mooncake), so every part is its own process.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Children die with us even if we are killed outright (Linux prctl PR_SET_PDEATHSIG).
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class UpError(RuntimeError):
    """A part could not start; the message says which, why, and where its log is."""


@dataclass
class Part:
    """One child process of the system."""

    name: str
    argv: list[str]
    port: int
    health_url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    extra_ports: list[int] = field(default_factory=list)
    device: str = ""  # an engine's --device (shown at start)

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, n: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines[-n:])

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass(frozen=True)
class UpSettings:
    model: str = "smollm2"
    device: str = "cpu"
    prefill: int = 1
    decode: int = 1
    workers: int = 2
    pd: bool = True
    host: str = "127.0.0.1"
    port: int = 30000
    metrics_port: int = 29000
    engine_port: int = 8010
    handshake_port: int = 6301
    kv_events_port: int = 5557  # with --policy kv_aware: engine i publishes on this + 2i, replays on + 2i + 1
    policy: str = "cache_aware"
    kv_cache_memory_gb: float = 1.0
    max_model_len: int = 2048
    log_dir: Path = Path(".atomesh/logs")
    startup_timeout: float = 600.0
    engine_args: tuple[str, ...] = ()
    gpus: int | None = None  # GPUs to place engines on with device cuda; None: those visible (visible_gpus)


GPU_MEMORY_SHARE = 0.85  # of each GPU, split between the engines placed on it


def visible_gpus() -> int:
    """GPUs the engines can see: CUDA_VISIBLE_DEVICES when set, else ``nvidia-smi -L``'s list (0 when neither)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def place_on_gpus(roles: list[str], gpus: int) -> list[tuple[str, float]]:
    """Each engine's ``--device`` and ``--gpu-memory-utilization``, in ``roles`` order.

    One GPU (or none known): every engine on ``cuda``, each its share of the card. More: one engine
    per GPU as far as they go; with P/D, prefill and decode engines on distinct GPUs (the GPUs split
    between the two pools in proportion to their engines, at least one each), round robin within a
    pool; engines that still share a GPU split it.
    """
    if gpus <= 1:
        return [("cuda", round(GPU_MEMORY_SHARE / len(roles), 3))] * len(roles)
    pd = "prefill" in roles and "decode" in roles
    if pd:
        n_prefill = roles.count("prefill")
        k = min(gpus - 1, max(1, round(gpus * n_prefill / len(roles))))
        pools = {"prefill": list(range(k)), "decode": list(range(k, gpus))}
    else:
        pools = {role: list(range(gpus)) for role in set(roles)}
    seen: dict[str, int] = {}
    chosen = []
    for role in roles:
        pool = pools[role]
        i = seen[role] = seen.get(role, -1) + 1
        chosen.append(pool[i % len(pool)])
    return [(f"cuda:{g}", round(GPU_MEMORY_SHARE / chosen.count(g), 3)) for g in chosen]


def mps_running() -> bool:
    """Whether an NVIDIA MPS control daemon answers where CUDA clients look for it (its pipe directory)."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


def sharing_note(parts: list[Part], mps: bool) -> str | None:
    """A line for engines that share one GPU without MPS: the driver then runs their kernels in turns.

    Measured on an H200 (docs/pd.md, "One GPU under MPS"): a prefill and a decode engine of an 8B model on one
    GPU gave 0.79-0.94x colocated tok/s time-sliced and 0.96-1.04x under MPS.
    """
    shared: dict[str, list[str]] = {}
    for p in parts:
        if p.device.startswith("cuda"):
            shared.setdefault(p.device, []).append(p.name)
    crowded = {d: names for d, names in shared.items() if len(names) > 1}
    if not crowded or mps:
        return None
    where = "; ".join(f"{', '.join(names)} on {d}" for d, names in crowded.items())
    return (f"note: {where} share a GPU without NVIDIA MPS, so their kernels take turns; start it first "
            "(nvidia-cuda-mps-control -d) to run them side by side (docs/pd.md)")  # fmt: skip


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def served_name(model: str) -> str:
    """The model name clients use: the embedded model's real name, else what was given."""
    return "SmolLM2-135M-Instruct" if model in ("smollm2", "default") else model


def plan_parts(s: UpSettings) -> list[Part]:
    """The processes to start, engines first, the gateway last."""
    py = sys.executable
    parts: list[Part] = []
    engine_port, handshake = s.engine_port, s.handshake_port
    roles = (["prefill"] * s.prefill + ["decode"] * s.decode) if s.pd else ["worker"] * s.workers
    counts: dict[str, int] = {}
    placed: list[tuple[str, float]] | None = None
    if s.device == "cuda":
        placed = place_on_gpus(roles, visible_gpus() if s.gpus is None else s.gpus)
    for n, role in enumerate(roles):
        i = counts[role] = counts.get(role, -1) + 1
        device = placed[n][0] if placed else s.device
        argv = [
            py,
            "-m",
            "engine.openai_server",
            "--model",
            s.model,
            "--served-model-name",
            served_name(s.model),
            "--host",
            s.host,
            "--server-port",
            str(engine_port),
            "--device",
            device,
            "--max-model-len",
            str(s.max_model_len),
            "--kv-cache-memory-gb",
            str(s.kv_cache_memory_gb),
            # A dead engine (a CUDA fault) ends its process, so that `up` shows it and stops the rest.
            "--exit-on-engine-error",
            *s.engine_args,
        ]
        if placed:
            # Each engine its share of its GPU (the KV pool is what the share leaves).
            argv += ["--gpu-memory-utilization", f"{placed[n][1]:.3f}"]
        elif s.device != "cpu":  # auto: the engines decide the device; assume they share one
            argv += ["--gpu-memory-utilization", f"{GPU_MEMORY_SHARE / len(roles):.3f}"]
        extra = []
        if s.policy == "kv_aware":
            # kv_aware places by the engines' own KV events, which an engine publishes only when told to;
            # the gateway finds the addresses in its /server_info (`*`: the worker's host).
            pub = s.kv_events_port + 2 * len(parts)
            argv += [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://*:{pub}",
                        "replay_endpoint": f"tcp://*:{pub + 1}",
                    }
                ),
            ]
            extra += [pub, pub + 1]
        if role != "worker":
            kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
            argv += [
                "--kv-transfer-config",
                json.dumps({"kv_role": kv_role, "kv_connector": "mooncake", "handshake_port": handshake}),
            ]
            extra.append(handshake)
            handshake += 1
        parts.append(
            Part(
                f"{role}-{i}",
                argv,
                engine_port,
                f"http://{s.host}:{engine_port}/health",
                s.log_dir / f"{role}-{i}.log",
                extra_ports=extra,
                device=device,
            )
        )
        engine_port += 1
    urls = {p.name: f"http://{s.host}:{p.port}" for p in parts}
    gw = [
        py,
        "-m",
        "atomesh",
        "launch",
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--prometheus-host",
        s.host,
        "--prometheus-port",
        str(s.metrics_port),
        "--policy",
        s.policy,
        "--worker-startup-check-interval",
        "1",
    ]
    if s.pd:
        gw += ["--pd-disaggregation", "--backend", "atom"]
        for name, url in urls.items():
            gw += ["--prefill", url, "none"] if name.startswith("prefill") else ["--decode", url]
    else:
        gw += ["--worker-urls", *urls.values()]
    parts.append(
        Part(
            "gateway",
            gw,
            s.port,
            f"http://{s.host}:{s.port}/readiness",
            s.log_dir / "gateway.log",
            extra_ports=[s.metrics_port],
        )
    )
    return parts


Say = Callable[[str], None]


class System:
    """Starts the parts in order, watches them, stops them all."""

    def __init__(self, settings: UpSettings, say: Say = print) -> None:
        self.settings = settings
        self.say = say
        self.parts = plan_parts(settings)
        self.stop_requested = False

    def check_ports(self) -> None:
        busy = [
            f"{p.name} needs {port}"
            for p in self.parts
            for port in (p.port, *p.extra_ports)
            if port_in_use(self.settings.host, port)
        ]
        if busy:
            raise UpError(
                "ports already in use: "
                + "; ".join(busy)
                + " (stop what holds them, or choose others with --port / --engine-port / --metrics-port)"
            )

    def start(self) -> None:
        self.check_ports()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        engines, gateway = self.parts[:-1], self.parts[-1]
        if note := sharing_note(engines, mps_running()):
            self.say(note)
        for p in engines:  # engines load their models in parallel
            p.start(env)
            on = f" {p.device}" if p.device.startswith("cuda") else ""
            self.say(f"  starting {p.name:<10} on :{p.port}{on}  (log: {p.log_path})")
        self._wait(engines)
        gateway.start(env)
        self.say(f"  starting {'gateway':<10} on :{gateway.port}  (log: {gateway.log_path})")
        self._wait([gateway])

    def _wait(self, parts: list[Part]) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout
        pending = list(parts)
        while pending:
            if self.stop_requested:
                raise KeyboardInterrupt
            for p in list(pending):
                if not p.alive():
                    code = p.proc.returncode if p.proc else None
                    raise UpError(
                        f"{p.name} exited with code {code} while starting; its log {p.log_path} ends:\n{p.tail()}"
                    )
                if p.healthy():
                    pending.remove(p)
                    self.say(f"  ready    {p.name:<10} in {time.monotonic() - p.started_at:5.1f} s")
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise UpError(
                    f"{names} not ready after {self.settings.startup_timeout:g} s; see {self.settings.log_dir}"
                )
            time.sleep(0.25)

    def watch(self, stop: Callable[[], bool]) -> None:
        """Return when `stop()` says so; raise UpError if a part dies meanwhile."""
        while not stop():
            for p in self.parts:
                if not p.alive():
                    code = p.proc.returncode if p.proc else None
                    raise UpError(f"{p.name} exited with code {code}; its log {p.log_path} ends:\n{p.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        for p in reversed(self.parts):  # the gateway first, so it stops taking requests
            p.stop()


def venv_command(name: str) -> str:
    """How to run `name` from this interpreter's environment in another terminal, without activating it:
    `.venv/bin/python` under the current folder, else the absolute path."""
    path = Path(sys.executable).parent / name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def usage_text(s: UpSettings) -> str:
    base = f"http://{s.host}:{s.port}"
    python = venv_command("python")
    model = served_name(s.model)
    mode = (
        f"P/D: {s.prefill} prefill + {s.decode} decode "
        "(atom backend, KV through the engines' shared pools on this host, else Mooncake)"
        if s.pd
        else f"{s.workers} regular workers"
    )
    return f"""
atomesh is up: {mode}

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}],
         "max_tokens": 32, "temperature": 0}}'

  {python} - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=64, temperature=0,
                                              messages=[{{"role": "user", "content": "Tell me about Paris."}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  EOF

  workers:  curl {base}/workers
  metrics:  http://{s.host}:{s.metrics_port}/metrics   (engines: {base}/engine_metrics)
  logs:     {s.log_dir}/
  bench:    {python} -m bench.gateway.serving --base-url {base} --random-input-len 256 --random-output-len 64
            (from the root of an atomesh checkout: the benchmarks are not installed)

Ctrl-C stops everything.
"""


def run_up(settings: UpSettings, say: Say = print) -> int:
    """Run the system until Ctrl-C / SIGTERM; returns the exit code."""
    system = System(settings, say)

    def on_signal(signum: int, frame: object) -> None:
        system.stop_requested = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        say(f"atomesh up: starting {len(system.parts)} processes")
        system.start()
        say(usage_text(settings))
        system.watch(lambda: system.stop_requested)
        say("stopping ...")
        return 0
    except UpError as e:
        say(f"atomesh up: error: {e}")
        return 1
    except KeyboardInterrupt:
        say("stopping ...")
        return 0
    finally:
        system.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        say("stopped")
