"""atomesh's benchmarks, outside the runtime packages: `bench.gateway` (the gateway against SMG and the
placement policies), `bench.engine` (the engine worker: throughput, P/D, KV transfer, speculative decoding),
`bench/device` (the GPU runs' shell scripts). Run each with `python -m bench.PART.NAME` from a checkout's
root (`--help` lists its options). They import `atomesh` and `engine`; neither imports them, and the wheel
does not ship them.
"""
