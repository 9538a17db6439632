# Sourced on the GPU machine after bench/device/setup.sh: puts the trimmed CUDA Mooncake bundle
# (.gpu/mooncake-cuda.tar.xz, made by bench/device/mooncake_bundle.sh) in front of the CPU-only wheel, and
# the Debian verbs libraries and libcudart.so.12 on the loader's path. Checks that it imports.
BUNDLE=${BUNDLE:-.gpu/mooncake-cuda.tar.xz}
if [ ! -f "$BUNDLE" ]; then echo "no $BUNDLE: run bench/device/mooncake_bundle.sh on the developer's machine"; return 1; fi
mkdir -p /tmp/mooncake-cuda && tar -C /tmp/mooncake-cuda -xJf "$BUNDLE"
if [ -d .deb ]; then
  mkdir -p /tmp/ibv && for f in .deb/*.deb; do dpkg -x "$f" /tmp/ibv; done
  export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
cudart=$(python3 -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$cudart" ] && export LD_LIBRARY_PATH=$cudart:$LD_LIBRARY_PATH
# The CPU-only wheel (if installed under /tmp/site) would win the backend check: the bundle goes first, and
# its dist-info says mooncake-transfer-engine.
rm -rf /tmp/site/mooncake_transfer_engine_non_cuda-*.dist-info
export PYTHONPATH=/tmp/mooncake-cuda:${PYTHONPATH:-}
python3 -c 'from engine.kv_transfer.backend import installed_wheel; import mooncake.engine; print("mooncake:", installed_wheel().value)'
