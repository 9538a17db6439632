"""`atomesh launch`: flags, config files, refusals, and a real process serving and shutting down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from gwtest import free_port

from atomesh.cli import normalize_argv
from atomesh.config import ConfigError, GatewayConfig, load_config

ATOMESH = [sys.executable, "-m", "atomesh"]


def http_status(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ATOMESH, *args], capture_output=True, text=True, timeout=timeout)


def test_multi_value_flags_are_normalised() -> None:
    assert normalize_argv(["--worker-urls", "http://a:1", "http://b:2", "--port", "9"]) == [
        "--worker-urls",
        "http://a:1",
        "--worker-urls",
        "http://b:2",
        "--port",
        "9",
    ]
    assert normalize_argv(
        [
            "--prefill",
            "http://p:1",
            "8998",
            "--prefill",
            "http://q:1",
            "none",
            "--prefill",
            "http://r:1",
            "--decode",
            "http://d:1",
        ]
    ) == [
        "--prefill",
        "http://p:1 8998",
        "--prefill",
        "http://q:1 none",
        "--prefill",
        "http://r:1",
        "--decode",
        "http://d:1",
    ]


def test_flags_win_over_the_config_file(tmp_path: Path) -> None:
    f = tmp_path / "gw.yaml"
    f.write_text("port: 31000\npolicy: random\nworker-urls: [http://a:1]\nretry_max_retries: 2\n")
    cfg = load_config({"config": f, "policy": "round_robin"})
    assert (cfg.port, cfg.policy, cfg.worker_urls, cfg.retry_max_retries) == (31000, "round_robin", ["http://a:1"], 2)


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"worker_urls": ["ftp://x"]}, "--worker-urls"),
        ({"request_timeout_secs": -1}, "--request-timeout-secs"),
        ({"policy": "fastest"}, "unknown policy"),
        ({"prefill": [{"url": "http://p:1"}]}, "--prefill needs --pd-disaggregation"),
        ({"port": 70000}, "--port"),
        ({"tls_cert_path": "/x.pem"}, "--tls-key-path"),
        ({"dp_aware": True, "pd_disaggregation": True}, "regular mode only"),
        ({"policy": "bucket"}, "policy 'bucket' is refused"),
        ({"chat_template": "/x.jinja"}, "--chat-template needs --model-path or --tokenizer-path"),
        ({"client_cert_path": "/c.pem"}, "--client-key-path"),
        ({"service_discovery": True}, "--service-discovery needs --selector"),
        ({"bogus_setting": 1}, "bogus_setting"),
    ],
)
def test_invalid_settings_are_refused_with_one_line(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(flags)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_yaml_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config({"config": f})


def test_every_setting_has_a_flag_and_a_description() -> None:
    help_text = run_cli("launch", "--help").stdout
    for name, field in GatewayConfig.model_fields.items():
        assert "--" + name.replace("_", "-") in help_text, name
        assert field.description, name
    assert "--runtime" in help_text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--worker-urls", "not-a-url"], "--worker-urls"),
        (["--prefill", "http://127.0.0.1:1", "8998"], "--prefill needs --pd-disaggregation"),
        (["--queue-timeout-secs", "-5"], "--queue-timeout-secs"),
        (["--policy", "nope"], "unknown policy"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_launch_stops_with_a_clear_line_and_nonzero_exit(args: list[str], needle: str) -> None:
    proc = run_cli("launch", *args)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(90)
def test_launch_serves_then_exits_cleanly_on_sigterm() -> None:
    wport, port, mport = free_port(), free_port(), free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "atomesh.testing.mock_worker", "--port", str(wport)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gw = subprocess.Popen(
        [
            *ATOMESH,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(mport),
            "--worker-urls",
            f"http://127.0.0.1:{wport}",
            "--policy",
            "round_robin",
            "--worker-startup-check-interval",
            "0.2",
            "--json-log",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if http_status(f"http://127.0.0.1:{port}/readiness")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "gateway never became ready"
            assert gw.poll() is None, "gateway exited early"
            time.sleep(0.1)
        status, body = http_status(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "tok0 tok1"
        assert http_status(f"http://127.0.0.1:{mport}/metrics")[0] == 200
        gw.send_signal(signal.SIGTERM)
        out, _ = gw.communicate(timeout=30)
        assert gw.returncode == 0, out
        assert "shutdown_complete" in out
    finally:
        for p in (gw, worker):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_configuration_reference_is_in_sync() -> None:
    from atomesh.cli import reference_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert doc.read_text() == reference_markdown(), "run: atomesh config-reference > docs/configuration.md"


@pytest.mark.timeout(60)
def test_help_shows_whole_option_names_on_an_80_column_terminal() -> None:
    env = {**os.environ, "COLUMNS": "80"}
    for args, names in (
        (["up"], ["--kv-cache-memory-gb", "--startup-timeout"]),
        (["launch"], ["--health-check-interval-secs", "--access-log-sample-rate"]),
    ):
        out = subprocess.run([*ATOMESH, *args, "--help"], capture_output=True, text=True, timeout=30, env=env).stdout
        assert "…" not in out and "╭" not in out, out[:400]  # one plain style, nothing cut
        assert all(n in out for n in names), (args, out[:400])
