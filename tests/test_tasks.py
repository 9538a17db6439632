"""PeriodicTask: one owner starts, cancels and awaits it; a failing round is logged and retried with backoff."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from gwtest import wait_for

from atomesh.tasks import PeriodicTask

pytestmark = pytest.mark.timeout(30)


async def test_rounds_repeat_until_stop_which_waits_for_the_end() -> None:
    rounds: list[int] = []

    async def round_() -> None:
        rounds.append(len(rounds))

    task = PeriodicTask("t", 0.01, round_, first_delay=0.0)
    task.start()
    task.start()  # a second start while running is a no-op: still one task
    await wait_for(lambda: len(rounds) >= 3, what="three rounds")
    assert task.running
    await task.stop()
    assert not task.running
    done = len(rounds)
    await asyncio.sleep(0.05)
    assert len(rounds) == done  # nothing runs after stop() returned
    await task.stop()  # stopping twice is fine


async def test_a_failing_round_is_logged_and_the_task_goes_on_with_backoff() -> None:
    calls: list[str] = []

    def round_() -> None:  # a plain function is a round too
        calls.append("call")
        if len(calls) in (2, 3):
            raise RuntimeError("boom")

    task = PeriodicTask("flaky", 0.01, round_, first_delay=0.0, max_backoff=0.04)
    with structlog.testing.capture_logs() as logs:
        task.start()
        await wait_for(lambda: len(calls) >= 5, what="rounds after the failures")
        await task.stop()
    failures = [e for e in logs if e["event"] == "periodic_round_failed"]
    assert [e["failures"] for e in failures] == [1, 2]
    assert all(e["task"] == "flaky" and e["log_level"] == "error" for e in failures)
    assert task.failures == 0  # a round that passes resets the streak


def test_backoff_doubles_up_to_its_cap() -> None:
    task = PeriodicTask("t", 1.0, lambda: None, max_backoff=5.0)
    delays = []
    for n in range(1, 6):
        task.failures = n
        delays.append(task.delay_after_failure())
    assert delays == [2.0, 4.0, 5.0, 5.0, 5.0]
    assert PeriodicTask("t", 10.0, lambda: None, max_backoff=1.0).max_backoff == 10.0  # never below the interval
    with pytest.raises(ValueError, match="interval"):
        PeriodicTask("t", 0, lambda: None)


async def test_cancel_ends_the_task_and_stop_awaits_it() -> None:
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        await asyncio.sleep(60)

    task = PeriodicTask("slow", 0.01, slow, first_delay=0.0)
    task.start()
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()  # from a callback that cannot await: the owner's stop() still waits for the end
    await asyncio.wait_for(task.stop(), 5)
    assert not task.running


@pytest.mark.timeout(20)
async def test_stop_ends_a_round_that_swallowed_its_cancellation() -> None:
    # Python 3.11's asyncio.wait_for swallows a cancellation that arrives as its inner await completes (a
    # health probe's connect refused at that moment): the round returns normally and the loop goes on. stop()
    # cancels again until the task has ended.
    swallowed = 0

    async def round_() -> None:
        nonlocal swallowed
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed += 1  # as wait_for does in that race (rare: once here): the cancellation is lost

    task = PeriodicTask("swallows", 0.01, round_)
    task.start()
    await asyncio.sleep(0.1)
    inner = task._task
    assert inner is not None
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait({asyncio.ensure_future(task.stop())}, timeout=8)
    assert inner.done(), "the task went on after stop() cancelled it"
    assert loop.time() - started < 5 and swallowed == 1
