"""Fixtures for the gateway tests; they live in gwtest.py so that test modules can import its helpers
by a name no other conftest.py shadows."""

from gwtest import gateway, http, mock_workers, worker_processes  # noqa: F401
