"""Per-worker circuit breaker: Closed -> Open -> HalfOpen -> Closed, as SMG / ATOMesh do it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_secs: float = 60.0
    window_secs: float = 120.0
    enabled: bool = True


# Called with (old, new) on every state change; metrics and logs hang off it.
TransitionHook = Callable[[BreakerState, BreakerState], None]


@dataclass(slots=True)
class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures inside the window; probes after the timeout.

    While half-open, traffic is let through (requests are the probes); `success_threshold` successes
    close the breaker and any failure opens it again.
    """

    settings: BreakerSettings = field(default_factory=BreakerSettings)
    on_transition: TransitionHook | None = None
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    successes: int = 0
    first_failure_at: float = 0.0
    opened_at: float = 0.0

    @property
    def is_open(self) -> bool:
        """Refusing traffic now: open, and its timeout not over yet. A pure query (changes nothing)."""
        return (
            self.settings.enabled
            and self.state is BreakerState.OPEN
            and self.clock() - self.opened_at < self.settings.timeout_secs
        )

    def admit(self) -> bool:
        """Whether a request may go to the worker now. Changes state: an open breaker whose timeout is
        over moves to half-open here, and the request admitted is its probe."""
        if not self.settings.enabled or self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self.clock() - self.opened_at < self.settings.timeout_secs:
                return False
            self._move(BreakerState.HALF_OPEN)
        return True

    def record(self, ok: bool) -> None:
        if not self.settings.enabled:
            return
        if ok:
            self._success()
        else:
            self._failure()

    def trip(self) -> None:
        """Open now, whatever the count: the worker was seen to be down (it refused a connection)."""
        if self.settings.enabled and self.state is not BreakerState.OPEN:
            self._move(BreakerState.OPEN)

    def _success(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.successes += 1
            if self.successes >= self.settings.success_threshold:
                self._move(BreakerState.CLOSED)
        else:
            self.failures = 0

    def _failure(self) -> None:
        now = self.clock()
        if self.state is BreakerState.HALF_OPEN:
            self._move(BreakerState.OPEN)
            return
        if self.state is BreakerState.OPEN:
            return
        if self.failures == 0 or now - self.first_failure_at > self.settings.window_secs:
            self.failures = 0
            self.first_failure_at = now
        self.failures += 1
        if self.failures >= self.settings.failure_threshold:
            self._move(BreakerState.OPEN)

    def _move(self, new: BreakerState) -> None:
        old, self.state = self.state, new
        self.failures = 0
        self.successes = 0
        if new is BreakerState.OPEN:
            self.opened_at = self.clock()
        if self.on_transition is not None:
            self.on_transition(old, new)

    def describe(self) -> dict[str, Any]:
        return {"state": self.state.value, "consecutive_failures": self.failures, "enabled": self.settings.enabled}
