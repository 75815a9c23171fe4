#!/usr/bin/env bash
# Developer build without installing: builds the module into BUILD_DIR and assembles an importable
# package at BUILD_DIR/pkg/gdn (links to python/gdn/*.py plus the built _C and, when torch is
# importable, the torch op kernels). Then:
#   PYTHONPATH=BUILD_DIR/pkg pytest tests/py
# Usage: scripts/dev_build.sh BUILD_DIR [extra cmake args, e.g. -DGDN_ENABLE_CUDA=ON]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: scripts/dev_build.sh BUILD_DIR [cmake args]}
shift
mkdir -p "$build"
build=$(cd "$build" && pwd)
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DGDN_BUILD_PYTHON=ON -DGDN_ENABLE_CUDA=OFF \
    -Dnanobind_DIR="$(python3 -m nanobind --cmake_dir)" "$@"
fi
cmake --build "$build" -j "${GDN_BUILD_JOBS:-2}"
pkg="$build/pkg/gdn"
rm -rf "$pkg" && mkdir -p "$pkg"
for f in "$root"/python/gdn/*; do ln -s "$f" "$pkg/"; done
ln -sf "$build"/_C*.so "$pkg/"
# The torch op kernels and the torch version they were built against, when built.
for f in "$build"/libgdn_torch_ops.so "$build"/torch_ops.json; do
  if [ -e "$f" ]; then ln -sf "$f" "$pkg/"; fi
done
echo "PYTHONPATH=$build/pkg"
