#!/usr/bin/env bash
# Copies the system GoogleTest (Debian libgtest-dev: headers, static libs, CMake config) into
# .deps/gtest, so a machine without it (and without network) can build the C++ tests with
# -DGTest_DIR=$PWD/.deps/gtest/lib/x86_64-linux-gnu/cmake/GTest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dst="$root/.deps/gtest"
rm -rf "$dst" && mkdir -p "$dst/include" "$dst/lib/x86_64-linux-gnu"
cp -r /usr/include/gtest "$dst/include/"
cp /usr/lib/x86_64-linux-gnu/libgtest*.a "$dst/lib/x86_64-linux-gnu/"
mkdir -p "$dst/lib/x86_64-linux-gnu/cmake" && cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$dst/lib/x86_64-linux-gnu/cmake/"
echo "$dst"
