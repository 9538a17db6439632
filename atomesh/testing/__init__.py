"""Test and benchmark helpers shipped with the package (mock workers)."""
