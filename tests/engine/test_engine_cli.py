"""``python -m engine.openai_server`` as a real process: ATOM flags accepted, unsupported ones refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import pytest

from engine.args import parse_args

MODULE = [sys.executable, "-m", "engine.openai_server"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-tp", "0"], "--tensor-parallel-size/-tp 0: must be at least 1"),
        (
            ["--data-parallel-size", "2"],
            "--data-parallel-size/-dp 2: data parallelism (ATOM's DP attention) is not built",
        ),
        (["--enable-expert-parallel"], "--enable-expert-parallel needs --tensor-parallel-size > 1"),
        (["-pp", "2"], "--pipeline-parallel-size/-pp 2: only 1 is supported"),
        (["--method", "eagle3", "--num-speculative-tokens", "3"], "--method: method 'eagle3' needs the draft head's"),
        (["--method", "mtp", "--num-speculative-tokens", "1"], "multi-token-prediction (MTP) drafts are not"),
        (["--method", "ngram"], "num_speculative_tokens None must be an integer"),
        (["--num-speculative-tokens", "2"], "--num-speculative-tokens and --draft-model need --method"),
        (["--draft-model", "x"], "--num-speculative-tokens and --draft-model need --method"),
        (
            ["--method", "ngram", "--num-speculative-tokens", "2", "--draft-model", "x"],
            "method 'ngram' drafts from the text itself and takes no draft model",
        ),
        (
            [
                "--speculative-config",
                '{"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "prompt_lookup_max": 3}',
            ],
            "prompt_lookup_min/max are settings of method 'ngram', not of 'eagle3'",
        ),
        (
            ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'],
            "method 'eagle3' needs the draft head's folder",
        ),
        (
            ["--speculative-config", '{"method": "eagle", "model": "h", "num_speculative_tokens": 3}'],
            "EAGLE (1/2) draft heads are not implemented",
        ),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "must be an integer in 1..16"),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            ],
            "prompt_lookup_min 4 is above prompt_lookup_max 2",
        ),
        (
            ["--method", "ngram", "--num-speculative-tokens", "2", "--sparse-attention", "on"],
            "speculative decoding with --sparse-attention on is not supported",
        ),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "acceptance": 1}'],
            "unsupported keys ['acceptance']",
        ),
        (["--port", "8006"], "use --server-port"),
        (["--long-prefill-token-threshold", "-1"], "must be >= 0"),
        (["--kv-transfer-config", '{"kv_role": "kv_both"}'], "not implemented yet"),
        (["--kv-transfer-config", '{"kv_role": "boss"}'], "kv_role 'boss' must be one of"),
        (["--kv-transfer-config", "{nope"], "not valid JSON"),
        (["--kv-transfer-config", '{"kv_buffer_size": 1}'], "unsupported keys ['kv_buffer_size']"),
        (["--kv_cache_dtype", "int4"], "invalid choice: 'int4'"),
        (["--block-size", "12"], "power of two"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--device", "gpu"], "invalid device 'gpu': choose auto, cpu, cuda or cuda:N"),
        (["--device", "cuda:x"], "invalid device 'cuda:x'"),
    ],
)
def test_bad_flags_exit_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_device_index_is_accepted_and_checked_against_the_gpus_torch_sees() -> None:
    from engine.llm_engine import resolve_device

    assert [parse_args(["--device", d]).device for d in ("cpu", "cuda", "cuda:3")] == ["cpu", "cuda", "cuda:3"]
    assert resolve_device("cpu").type == "cpu"
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda:1: torch sees no CUDA device"):
            resolve_device("cuda:1")
        return
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"torch sees {count} GPU"):
        resolve_device(f"cuda:{count}")
    last = resolve_device(f"cuda:{count - 1}")  # one engine per GPU: the last GPU becomes the current one
    assert last.index == count - 1 and torch.cuda.current_device() == count - 1
    torch.cuda.set_device(0)


def test_atom_command_line_parses() -> None:
    args = parse_args(
        [
            "--model", "smollm2", "--server-port", "8010", "-tp", "1", "--block-size", "16",
            "--gpu-memory-utilization", "0.8", "--max-model-len", "4096", "--max-num-batched-tokens", "8192",
            "--max-num-seqs", "64", "--kv_cache_dtype", "bf16", "--no-enable_prefix_caching",
            "--kv-transfer-config", '{"kv_connector": "mooncake", "handshake_port": 6302, "proxy_ip": "1.2.3.4"}',
            "--enforce-eager", "--trust-remote-code",
        ]
    )  # fmt: skip
    assert args.server_port == 8010 and args.max_model_len == 4096 and not args.enable_prefix_caching
    assert args.kv_cache_dtype == "bf16" and args.kv_transfer.handshake_port == 6302
    assert args.kv_transfer.kv_role is None and args.speculative is None


def test_speculative_flags_parse_in_both_spellings() -> None:
    vllm = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                       '"prompt_lookup_min": 2, "prompt_lookup_max": 5}'])  # fmt: skip
    assert vllm.speculative is not None
    assert (vllm.speculative.method, vllm.speculative.num_speculative_tokens) == ("ngram", 4)
    assert (vllm.speculative.prompt_lookup_min, vllm.speculative.prompt_lookup_max) == (2, 5)
    atom = parse_args(["--method", "ngram", "--num-speculative-tokens", "3"])
    assert atom.speculative is not None and atom.speculative.num_speculative_tokens == 3
    # vLLM's defaults: neither bound given: 5 and 5; one given: the other takes its value.
    assert (atom.speculative.prompt_lookup_min, atom.speculative.prompt_lookup_max) == (5, 5)
    eagle = parse_args(["--speculative-config",
                        '{"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 3}'])  # fmt: skip
    atom_eagle = parse_args(["--method", "eagle3", "--draft-model", "/heads/h", "--num-speculative-tokens", "3"])
    assert eagle.speculative == atom_eagle.speculative
    assert eagle.speculative is not None
    assert (eagle.speculative.method, eagle.speculative.model) == ("eagle3", "/heads/h")
    one = parse_args(["--speculative-config",
                      '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'])  # fmt: skip
    assert one.speculative is not None and one.speculative.prompt_lookup_min == 3


@pytest.mark.timeout(60)
def test_refusals_from_a_real_process() -> None:
    cases = (
        (["-dp", "2"], "DP attention"),
        (["--model", "/no/such/model.gguf"], "cannot load model '/no/such/model.gguf'"),
        # 1 MiB cut into 2 slots for each of 256 pulls in flight: slots smaller than one block.
        (
            [
                "--model",
                "tiny-random",
                "--device",
                "cpu",
                "--num-kvcache-blocks",
                "16",
                "--host",
                "127.0.0.1",
                "--server-port",
                "1",
                "--kv-transfer-config",
                '{"kv_role": "kv_consumer", "staging_buffer_mb": 1, "max_inflight_pulls": 256}',
            ],
            "staging_buffer_mb 1 is cut into 2 slots per max_inflight_pulls (256)",
        ),
    )
    # The three processes at once: each spends its seconds importing torch and the engine (on either core).
    procs = [subprocess.Popen([*MODULE, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _ in cases]  # fmt: skip
    try:
        for proc, (_, message) in zip(procs, cases, strict=True):
            _, stderr = proc.communicate(timeout=50)
            assert proc.returncode != 0
            assert message in stderr
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


@pytest.mark.timeout(90)
def test_server_process_serves_and_stops(free_port: Callable[[], int]) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*MODULE, "--model", "tiny-random:3", "--host", "127.0.0.1", "--server-port", str(port),
         "--num-kvcache-blocks", "64", "--max-model-len", "512", "--torch-threads", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if _get(f"http://127.0.0.1:{port}/health") == {"status": "ok"}:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            body = json.loads(resp.read())
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] <= 5
        assert _get(f"http://127.0.0.1:{port}/server_info")["model_id"] == "tiny-random:3"
        proc.terminate()  # SIGTERM: a clean shutdown, exit status 0
        assert proc.wait(timeout=20) == 0
        assert proc.stderr is not None and "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)


def test_kv_transfer_protocol_is_what_the_host_can_do(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """No RDMA device: TCP is asked for outright (no error line from Mooncake, and the log says tcp)."""
    from engine.args import parse_kv_transfer_config
    from engine.kv_transfer import mooncake

    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setattr(mooncake, "RDMA_DEVICES", tmp_path)
    assert mooncake.choose_protocol(None) == "tcp" and mooncake.choose_protocol("rdma") == "tcp"
    (tmp_path / "mlx5_0").mkdir()
    assert mooncake.choose_protocol(None) == "rdma" and mooncake.choose_protocol("tcp") == "tcp"
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert mooncake.choose_protocol("rdma") == "tcp"
    with pytest.raises(ValueError, match="protocol 'ib'"):
        mooncake.choose_protocol("ib")
    with pytest.raises(ValueError, match="protocol 'ib' must be one of"):
        parse_kv_transfer_config('{"kv_role": "kv_producer", "protocol": "ib"}')
    assert parse_kv_transfer_config('{"kv_role": "kv_producer", "protocol": "tcp"}').protocol == "tcp"


def test_early_offer_is_the_producers_setting() -> None:
    """``early_offer`` changes what a prefill engine answers; a decode engine would ignore it, so it refuses it."""
    from engine.args import parse_kv_transfer_config

    assert parse_kv_transfer_config('{"kv_role": "kv_producer", "early_offer": false}').early_offer is False
    assert parse_kv_transfer_config('{"kv_role": "kv_consumer"}').early_offer is True  # the default, not asked for
    with pytest.raises(ValueError, match="early_offer is the prefill engine's setting"):
        parse_kv_transfer_config('{"kv_role": "kv_consumer", "early_offer": false}')
    with pytest.raises(ValueError, match="must be true or false"):
        parse_kv_transfer_config('{"kv_role": "kv_producer", "early_offer": "yes"}')
