# One GPU call: engine tests on CUDA, the engine benchmark, the serving sweep through atomesh.
bash bench/device/engine_bench_main.sh
bash bench/device/serving.sh
