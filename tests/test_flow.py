"""FlowControl: drain waits for resume_writing (never polls) and fails once the connection is gone."""

from __future__ import annotations

import asyncio

import pytest

from atomesh.flow import FlowControl

pytestmark = pytest.mark.timeout(30)


class _Transport:
    def __init__(self) -> None:
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def _connection() -> tuple[FlowControl, _Transport]:
    conn = FlowControl()
    transport = _Transport()
    conn.transport = transport  # type: ignore[assignment]
    return conn, transport


async def test_drain_returns_at_once_unless_paused_then_waits_for_resume() -> None:
    conn, _ = _connection()
    await asyncio.wait_for(conn.drain(), 1)
    conn.pause_writing()
    waiter = asyncio.ensure_future(conn.drain())
    await asyncio.sleep(0)
    assert not waiter.done()
    conn.resume_writing()
    await asyncio.wait_for(waiter, 1)


async def test_drain_fails_when_the_connection_ends() -> None:
    conn, _ = _connection()
    conn.pause_writing()
    waiter = asyncio.ensure_future(conn.drain())
    await asyncio.sleep(0)
    conn.connection_ended()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(waiter, 1)
    with pytest.raises(ConnectionResetError):
        await conn.drain()


def test_hold_and_release_reading_are_idempotent() -> None:
    conn, transport = _connection()
    conn.hold_reading()
    conn.hold_reading()
    assert conn.reading_paused and not transport.reading
    conn.release_reading()
    conn.release_reading()
    assert not conn.reading_paused and transport.reading
