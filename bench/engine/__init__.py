"""The engine worker's benchmarks: `python -m bench.engine.NAME` (`--help` lists the options)."""
