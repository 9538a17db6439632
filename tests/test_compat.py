"""SMG and ATOMesh command lines: every peer flag is implemented with the peer's meaning or refused by name;
the policies and settings those flags turn on (consistent_hashing, dp ranks, tokenizer, TLS to workers)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, free_port, gateway_config, require, wait_for

from atomesh.app import GatewayServer
from atomesh.cli import drop_fixed_flags, launch_command, normalize_argv
from atomesh.compat import PEER_FLAGS, REFUSED_FLAGS, Status, refused_flag
from atomesh.config import ConfigError, load_config
from atomesh.gateway import StartupError
from atomesh.workers.worker import WorkerRole

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 2}
# ATOMesh's `mesh launch` flags (ROCm/ATOM atom/mesh/src/cliargs.rs on main, 2026-08-22).
ATOMESH_FLAGS = (
    "--host --port --worker-urls --policy --cache-threshold --balance-abs-threshold --balance-rel-threshold "
    "--eviction-interval --max-tree-size --prefix-token-count --prefix-hash-load-factor --dp-aware "
    "--pd-disaggregation --prefill --decode --prefill-policy --decode-policy --worker-startup-timeout-secs "
    "--worker-startup-check-interval --log-dir --log-level --json-log --prometheus-port --prometheus-host "
    "--prometheus-duration-buckets --request-id-headers --request-timeout-secs --shutdown-grace-period-secs "
    "--max-payload-size --max-concurrent-requests --queue-size --queue-timeout-secs --rate-limit-tokens-per-second "
    "--retry-max-retries --retry-initial-backoff-ms --retry-max-backoff-ms --retry-backoff-multiplier "
    "--retry-jitter-factor --disable-retries --cb-failure-threshold --cb-success-threshold "
    "--cb-timeout-duration-secs --cb-window-duration-secs --disable-circuit-breaker --health-failure-threshold "
    "--health-success-threshold --health-check-timeout-secs --health-check-interval-secs --health-check-endpoint "
    "--disable-health-check --model-path --tokenizer-path --chat-template --tokenizer-cache-enable-l0 "
    "--tokenizer-cache-l0-max-entries --tokenizer-cache-enable-l1 --tokenizer-cache-l1-max-memory "
    "--reasoning-parser --tool-call-parser --backend --runtime --api-key --atom-pd-rank-mapping-policy "
    "--tls-cert-path --tls-key-path"
).split()
# The spellings of SMG's Rust CLI that its Python launcher does not show.
SMG_RUST_FLAGS = ("--log-json", "--cache-match-threshold", "--spill-abs-threshold", "--spill-rel-threshold")


def launch_options() -> set[str]:
    return {o for p in launch_command.params for o in p.opts}


def test_every_peer_flag_is_listed_once() -> None:
    counts = Counter(f.flag for f in PEER_FLAGS)
    assert [f for f, n in counts.items() if n > 1] == []
    listed = set(counts)
    assert set(ATOMESH_FLAGS) <= listed, set(ATOMESH_FLAGS) - listed
    assert set(SMG_RUST_FLAGS) <= listed


SMG_VERSION = "1.13.0"  # pyproject.toml's bench extra pins it


def smg_launch_help() -> str:
    """`smg launch --help` of the pinned smg; fails (never skips) when that smg is not installed.

    It runs `python -m smg`, not the `smg` script: sglang-router 0.3.2, in the same extra, installs a
    script of that name too, and whichever package is installed last owns it (with sglang-router's, this
    test used to read the 98 flags of its old launcher and pass)."""
    try:
        version = importlib.metadata.version("smg")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            f"smg {SMG_VERSION} is not installed (pip install 'smg=={SMG_VERSION}', the bench extra; "
            "`make test` installs it): the flag table is checked against its help"
        )
    assert version == SMG_VERSION, f"smg {version} is installed; the table follows {SMG_VERSION}"
    proc = subprocess.run([sys.executable, "-m", "smg", "launch", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def smg_flags(help_text: str) -> tuple[set[str], set[str]]:
    """(the flags of the usage line, every spelling the options list: aliases and --no- forms too)."""
    usage = help_text.split("\n\n", 1)[0]  # `usage: ... [--host HOST] ...`, each flag once
    flags = set(re.findall(r"\[(--[a-z0-9][a-z0-9-]*)", usage))
    options = help_text.split("\noptions:", 1)[1]
    spellings = {
        f
        for line in re.findall(r"^  (-[^\n]*)$", options, re.M)
        for f in re.findall(r"(?:^|, )(--[a-z0-9][a-z0-9-]*)", line)
    } - {"--help"}
    return flags, spellings


@pytest.mark.timeout(90)
def test_every_flag_of_smg_launch_help_is_listed() -> None:
    flags, spellings = smg_flags(smg_launch_help())
    assert len(flags) == 211 and flags <= spellings, (len(flags), sorted(flags - spellings))
    missing = spellings - {f.flag for f in PEER_FLAGS}
    assert not missing, f"smg launch flags with no status in atomesh/compat.py: {sorted(missing)}"


def test_implemented_flags_parse_and_refused_ones_name_themselves() -> None:
    options = launch_options()
    for f in PEER_FLAGS:
        if f.status is Status.REFUSED:
            assert f.flag not in options
            line = refused_flag([f.flag + "=1"])
            assert line is not None and line.startswith(f.flag + " is refused: ") and f.note in line
        elif f.status is Status.FIXED:
            assert f.flag not in options and drop_fixed_flags(["--port", "1", f.flag]) == ["--port", "1"]
        else:
            assert f.flag in options, f.flag
            assert refused_flag([f.flag]) is None


@pytest.mark.timeout(60)
def test_a_refused_flag_stops_launch_with_its_name() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "atomesh",
            "launch",
            "--worker-urls",
            "http://127.0.0.1:1",
            "--tool-call-parser",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--tool-call-parser is refused" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def parsed(*argv: str) -> dict[str, object]:
    """The settings a command line gives, as `atomesh launch` reads them (no process started)."""
    ctx = launch_command.make_context("atomesh launch", normalize_argv(list(argv)))
    return {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in ctx.params.items()
        if ctx.get_parameter_source(k).name == "COMMANDLINE"
    }


def test_peer_command_lines_start() -> None:
    urls = ["--worker-urls", "http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    cfg = load_config(
        parsed(
            *urls,
            "--policy",
            "consistent_hashing",
            "--log-json",
            "--cache-match-threshold",
            "0.5",
            "--spill-abs-threshold",
            "8",
            "--spill-rel-threshold",
            "2",
            "--eviction-interval",
            "30",
            "--max-concurrent-requests",
            "-1",
            "--rate-limit-tokens-per-second",
            "0",
        )
    )
    assert (cfg.policy, cfg.json_log, cfg.cache_threshold, cfg.balance_abs_threshold) == (
        "consistent_hashing",
        True,
        0.5,
        8,
    )
    assert (cfg.balance_rel_threshold, cfg.eviction_interval_secs) == (2, 30)
    assert cfg.max_concurrent_requests == -1 and cfg.rate_limit_tokens_per_second == 0
    assert load_config(parsed(*urls, "--policy", "dp_sticky")).dp_ranks
    assert load_config(parsed(*urls, "--dp-aware", "--prefix-hash-load-factor", "1.5")).dp_ranks
    with pytest.raises(ConfigError, match="--history-backend is refused"):
        load_config({"history_backend": "memory"})  # a YAML key too


async def test_max_concurrent_requests_minus_one_is_derived_from_the_host() -> None:
    server = GatewayServer(gateway_config(max_concurrent_requests=-1))
    assert server.gateway.admission.limit is not None and server.gateway.admission.limit >= 1
    assert GatewayServer(gateway_config(max_concurrent_requests=0)).gateway.admission.limit is None
    assert GatewayServer(gateway_config(rate_limit_tokens_per_second=0)).gateway.admission.bucket is None


async def test_consistent_hashing_keeps_keys_and_honours_target(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(3)
    gw = await gateway(worker_urls=[w.url for w in workers], policy="consistent_hashing")
    url = base_url(gw) + "/v1/completions"

    async def served_by(headers: dict[str, str]) -> str:
        async with http.post(url, json=COMPLETION, headers=headers) as r:
            assert r.status == 200, await r.text()
            return r.headers["x-mock-worker"]

    for key in ("alice", "bob", "carol", "dave"):
        first = await served_by({"X-SMG-Routing-Key": key})
        assert all([await served_by({"X-SMG-Routing-Key": key}) == first for _ in range(3)])
    owners = {await served_by({"X-SMG-Routing-Key": f"user-{i}"}) for i in range(30)}
    assert len(owners) > 1  # keys spread over the workers
    # An implicit key: one client (its Authorization) keeps to one worker.
    assert len({await served_by({"Authorization": "Bearer client-7"}) for _ in range(4)}) == 1
    assert await served_by({"X-SMG-Target-Worker": "2"}) == "w2"
    assert await served_by({"X-SMG-Target-Worker": workers[1].url}) == "w1"
    async with http.post(url, json=COMPLETION, headers={"X-SMG-Target-Worker": "9"}) as r:
        assert r.status == 503 and "X-SMG-Target-Worker" in (await r.json())["error"]["message"]
    alone = await gateway(worker_urls=[workers[0].url], policy="consistent_hashing")
    async with http.post(
        base_url(alone) + "/v1/completions", json=COMPLETION, headers={"X-SMG-Target-Worker": workers[1].url}
    ) as r:
        assert r.status == 503  # one routable worker, but not the one asked for


async def test_dp_aware_sends_ranks_and_refuses_workers_without_them(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, dp_size=4)
    gw = await gateway(worker_urls=[w.url], dp_aware=True)
    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
    assert [x["body"]["data_parallel_rank"] for x in w.received if x["path"] == "/v1/completions"] == [0, 0, 0, 0]
    assert next(iter(gw.gateway.registry)).rank_in_flight == [0, 0, 0, 0]
    # dp_sticky: one routing key, one rank.
    sticky = await gateway(worker_urls=[w.url], policy="dp_sticky")
    ranks = set()
    for _ in range(3):
        async with http.post(
            base_url(sticky) + "/v1/completions", json=COMPLETION, headers={"X-Session-Id": "conversation-1"}
        ) as r:
            assert r.status == 200
        ranks.add(w.received[-1]["body"]["data_parallel_rank"])
    assert len(ranks) == 1
    [plain] = await mock_workers(1, dp_size=None)
    with pytest.raises(StartupError, match="reports no dp_size"):
        await gateway(worker_urls=[plain.url], dp_aware=True, worker_startup_timeout_secs=2)


def write_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "shared", "prefix", "a", "b"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


async def test_tokenizer_flags_load_or_stop_start_up(
    tmp_path: Path, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    require("tokenizers", "make install puts it in")
    require("jinja2", "make install puts it in")
    workers = await mock_workers(2)
    model = write_tokenizer(tmp_path / "model")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    gw = await gateway(
        worker_urls=[w.url for w in workers], policy="prefix_hash", model_path=str(model), chat_template=template
    )
    assert gw.gateway.tokens is not None and gw.gateway.tokens.template_found
    for _ in range(3):
        async with http.post(
            base_url(gw) + "/v1/chat/completions",
            json={"model": "mock-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hello world"}]},
        ) as r:
            assert r.status == 200
    assert sorted(len([x for x in w.received if x["path"] != "/health"]) for w in workers) == [0, 3]
    for settings, needle in (
        ({"model_path": "Qwen/Qwen3-8B"}, "not fetched"),
        ({"tokenizer_path": str(tmp_path)}, "holds no tokenizer.json"),
        ({"model_path": str(model), "chat_template": tmp_path / "none.jinja"}, "cannot read"),
    ):
        with pytest.raises(StartupError, match=needle):
            GatewayServer(gateway_config(worker_urls=[workers[0].url], **settings))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(StartupError, match="tokenizers"):
        GatewayServer(gateway_config(worker_urls=[workers[0].url], tokenizer_path=str(tmp_path / "bad")))


async def test_worker_tls_settings_are_loaded_or_refused(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="--ca-cert-paths"):
        GatewayServer(gateway_config(ca_cert_paths=[tmp_path / "missing.pem"]))
    assert REFUSED_FLAGS  # the table is not empty


async def test_passthrough_sends_everything_to_the_first_routable_worker(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers], policy="passthrough")
    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200 and r.headers["x-mock-worker"] == "w0"
    assert gw.gateway.load_poller is None  # nothing to compare: loads are not polled


async def test_manual_pins_each_routing_key_until_its_worker_goes(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(3)
    gw = await gateway(
        worker_urls=[w.url for w in workers[:2]],
        policy="manual",
        assignment_mode="min_group",
        routing_key_headers=["X-Conversation"],
    )
    url = base_url(gw) + "/v1/completions"

    async def served_by(key: str) -> str:
        async with http.post(url, json=COMPLETION, headers={"X-Conversation": key}) as r:
            assert r.status == 200, await r.text()
            return r.headers["x-mock-worker"]

    owners = {k: await served_by(k) for k in ("a", "b", "c", "d")}
    assert sorted(owners.values()) == ["w0", "w0", "w1", "w1"]  # min_group: two keys each
    # A worker that joins takes no key (consistent_hashing would move some).
    async with http.post(base_url(gw) + "/workers", json={"url": workers[2].url}) as r:
        assert r.status in (200, 202), await r.text()
    await wait_for(lambda: len(gw.gateway.registry.ready(WorkerRole.REGULAR)) == 3, what="w2 ready")
    assert {k: await served_by(k) for k in owners} == owners
    # A key whose worker is gone moves, then stays where it moved.
    await workers[0].stop()
    gone = [k for k, w in owners.items() if w == "w0"]
    moved = {k: await served_by(k) for k in gone}
    assert "w0" not in moved.values() and {k: await served_by(k) for k in gone} == moved
    with pytest.raises(ConfigError, match="--assignment-mode: assignment mode 'delegate' is refused"):
        load_config({"assignment_mode": "delegate"})
    with pytest.raises(ConfigError, match="policy 'bucket' is refused: SMG's bucket policy"):
        load_config({"prefill_policy": "bucket", "pd_disaggregation": True})


async def test_model_alias_and_a_request_without_model(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, models=["served-model"])
    gw = await gateway(worker_urls=[w.url], model_alias=["friendly=served-model"])
    url = base_url(gw) + "/v1/chat/completions"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name in ("friendly", "served-model", None):
        async with http.post(url, json=chat if name is None else {**chat, "model": name}) as r:
            assert r.status == 200, await r.text()
        assert w.received[-1]["body"]["model"] == "served-model"  # the worker sees its own name
    async with http.get(base_url(gw) + "/v1/models") as r:
        assert [(m["id"], m["root"]) for m in (await r.json())["data"]] == [
            ("served-model", "served-model"),
            ("friendly", "served-model"),
        ]
    async with http.post(url, json={**chat, "model": "other"}) as r:
        assert r.status == 404
    # Two models: a request must name one.
    [w2] = await mock_workers(1, models=["second-model"])
    two = await gateway(worker_urls=[w.url, w2.url])
    async with http.post(base_url(two) + "/v1/chat/completions", json=chat) as r:
        body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "model_required", body
        assert "second-model, served-model" in body["error"]["message"]
    with pytest.raises(ConfigError, match="expected ALIAS=CANONICAL"):
        load_config({"model_alias": ["no-equals"]})


@pytest.mark.timeout(60)
def test_fixed_switches_are_accepted_and_refused_values_named() -> None:
    argv = [
        "--worker-urls",
        "http://127.0.0.1:8001",
        "--disable-tokenizer-autoload",
        "--no-remove-unhealthy-workers",
        "--disable-load-monitoring",
        "--model",
        "/tmp/model",
        "--sticky-key-idle-secs",
        "60",
        "--header-read-timeout-secs",
        "0",
        "--worker-startup-delay",
        "1.5",
        "--load-monitor-interval",
        "2",
        "--upstream-pool-idle-timeout-secs",
        "3",
        "--atom-pd-rank-mapping-policy",
        "none",
    ]
    cfg = load_config(parsed(*drop_fixed_flags(argv)))
    assert (cfg.model_path, cfg.max_idle_secs, cfg.worker_startup_delay, cfg.load_monitor_interval) == (
        "/tmp/model",
        60,
        1.5,
        2,
    )
    assert cfg.http_head_timeout_secs >= 1e9 and cfg.upstream_pool_idle_timeout_secs == 3  # 0: no limit, as SMG
    assert load_config({"disable_tokenizer_autoload": True}).model_path is None  # a YAML key too
    for settings, needle in (
        ({"backend": "openai"}, "backend 'openai' is refused"),
        ({"discovery_provider": "file"}, "the file provider is refused"),
        ({"atom_pd_rank_mapping_policy": "idx2idx"}, "idx2idx is refused"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(settings)
    proc = subprocess.run(
        [sys.executable, "-m", "atomesh", "launch", "--worker-urls", "http://127.0.0.1:1", "--enable-mesh"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--enable-mesh is refused: SMG's HA mesh" in proc.stderr, proc.stderr


def test_readme_claims_what_the_table_checks() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    claim = " ".join(readme.split("Command lines written for SGLang's router", 1)[1].split("```", 1)[0].split())
    assert f"SMG {SMG_VERSION}, all 221 spellings" in claim and "docs/configuration.md#smg-and-atomesh-flags" in claim
    _, spellings = smg_flags(smg_launch_help())
    assert len(spellings) == 221 and spellings <= {f.flag for f in PEER_FLAGS}
    table = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert all(f"| `{f.flag}` |" in table for f in PEER_FLAGS)


async def test_routing_key_override_keeps_a_key_on_any_policy(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(3)
    assert load_config(parsed("--worker-urls", workers[0].url, "--sticky-sessions")).routing_key_override
    gw = await gateway(worker_urls=[w.url for w in workers], policy="round_robin", routing_key_override=True)
    url = base_url(gw) + "/v1/completions"

    async def served_by(headers: dict[str, str]) -> str:
        async with http.post(url, json=COMPLETION, headers=headers) as r:
            assert r.status == 200, await r.text()
            return r.headers["x-mock-worker"]

    for key in ("k1", "k2", "k3", "k4"):
        first = await served_by({"X-SMG-Routing-Key": key})
        assert {await served_by({"X-SMG-Routing-Key": key}) for _ in range(3)} == {first}
    assert len({await served_by({}) for _ in range(3)}) == 3  # without a key: round robin
    # A pinned worker that stops being routable: the policy places the key anew, and it stays there.
    owner = await served_by({"X-SMG-Routing-Key": "k9"})
    next(w for w in workers if w.name == owner).behaviour.fail_status = 500
    moved = await served_by({"X-SMG-Routing-Key": "k9"})
    assert moved != owner and await served_by({"X-SMG-Routing-Key": "k9"}) == moved


async def test_health_check_port_serves_the_probes(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    probe_port = free_port()
    gw = await gateway(worker_urls=[w.url], health_check_port=probe_port)
    for path, want in (("/liveness", 200), ("/readiness", 200), ("/health", 200)):
        async with http.get(f"http://127.0.0.1:{probe_port}{path}") as r:
            assert r.status == want, path
    async with http.post(f"http://127.0.0.1:{probe_port}/v1/completions", json=COMPLETION) as r:
        assert r.status == 404  # only the probes live there
    async with http.get(base_url(gw) + "/readiness") as r:
        assert r.status == 200  # and they stay on the service port
