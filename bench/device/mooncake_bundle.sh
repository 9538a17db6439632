#!/usr/bin/env bash
# Makes the trimmed CUDA Mooncake bundle the GPU machine can carry (issue #30, item 1), on the developer's
# machine (it needs PyPI; the GPU machine reaches no registry).
#
# The CUDA wheel (mooncake-transfer-engine, ~98 MB) holds far more than `mooncake.engine` loads. This keeps:
#   mooncake/*.py, mooncake/engine.so, libetcd_wrapper.so, libasio.so, nvlink_allocator.so (when present),
#   the libraries of mooncake_transfer_engine.libs/ those need (their DT_NEEDED closure: glog, gflags,
#   yaml-cpp, jsoncpp, ...), and the wheel's dist-info METADATA, so that engine.kv_transfer.backend sees the
#   CUDA build installed (and `memory_backend: auto` picks direct).
# It also downloads libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12) next to the bundle, and, where apt can,
# Debian's libibverbs / libnl / ibverbs-providers into .deb (bench/device/pd_serving.sh unpacks those).
#
#   bash bench/device/mooncake_bundle.sh            # -> .gpu/mooncake-cuda.tar.xz (+ .whl/nvidia_cuda_runtime*)
#   VERSION=0.3.13 PY=3.12 DEST=.gpu bash bench/device/mooncake_bundle.sh
#
# On the GPU machine: `source bench/device/mooncake_cuda.sh` unpacks it onto PYTHONPATH / LD_LIBRARY_PATH.
set -euo pipefail
VERSION=${VERSION:-}           # empty: the newest on PyPI
PY=${PY:-3.12}
DEST=${DEST:-.gpu}
PIP=${PIP:-python3 -m pip}
abi=cp${PY/./}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
spec=mooncake-transfer-engine${VERSION:+==$VERSION}
platforms=()
for v in 17 24 27 28 31 34 35 36 38 39; do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
$PIP download --no-deps --only-binary=:all: --python-version "$PY" --implementation cp --abi "$abi" \
  "${platforms[@]}" -d "$work/dl" "$spec"
wheel=$(ls "$work"/dl/mooncake_transfer_engine-*.whl)
echo "wheel: $(basename "$wheel") $(du -h "$wheel" | cut -f1)"
unzip -q "$wheel" -d "$work/wheel"
src=$work/wheel out=$work/bundle
mkdir -p "$out/mooncake"
cp "$src"/mooncake/*.py "$out/mooncake/"
for so in engine.so libetcd_wrapper.so libasio.so nvlink_allocator.so; do
  if [ -f "$src/mooncake/$so" ]; then cp "$src/mooncake/$so" "$out/mooncake/"; else echo "note: no mooncake/$so"; fi
done
libs=$(ls -d "$src"/mooncake_transfer_engine*.libs)
mkdir -p "$out/$(basename "$libs")"
# The DT_NEEDED closure of what we keep, within the wheel's bundled libraries (system ones stay outside).
todo=("$out"/mooncake/*.so)
declare -A kept=()
while [ ${#todo[@]} -gt 0 ]; do
  f=${todo[0]}; todo=("${todo[@]:1}")
  for need in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    if [ -f "$libs/$need" ] && [ -z "${kept[$need]:-}" ]; then
      kept[$need]=1
      cp "$libs/$need" "$out/$(basename "$libs")/"
      todo+=("$libs/$need")
    fi
  done
done
dist=$(ls -d "$src"/mooncake_transfer_engine-*.dist-info)
mkdir -p "$out/$(basename "$dist")" && cp "$dist/METADATA" "$out/$(basename "$dist")/"
mkdir -p "$DEST"
tar -C "$out" -cJf "$DEST/mooncake-cuda.tar.xz" .
echo "bundle: $DEST/mooncake-cuda.tar.xz $(du -h "$DEST/mooncake-cuda.tar.xz" | cut -f1) ($(du -sh "$out" | cut -f1) unpacked)"
echo "kept libraries: ${!kept[*]}"
# libcudart.so.12: the CUDA runtime engine.so links against (the GPU image's torch carries its own copy
# under nvidia/, but not always on the loader's path).
mkdir -p .whl
$PIP download --no-deps --only-binary=:all: --python-version "$PY" --implementation cp --abi "$abi" \
  "${platforms[@]}" -d .whl "nvidia-cuda-runtime-cu12"
if command -v apt-get >/dev/null; then
  mkdir -p .deb && (cd .deb && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 ibverbs-providers) \
    || echo "note: apt-get download failed; carry libibverbs1, libnl-3-200, libnl-route-3-200, ibverbs-providers"
fi
