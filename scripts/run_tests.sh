#!/usr/bin/env bash
# Builds libgdn (Python module + C++ tests) and runs every test: ctest (labels cpu, gpu,
# packaging) and pytest. GPU tests skip with a reason when no device is present; CUDA sources are
# compiled whenever nvcc is found (GDN_ENABLE_CUDA=AUTO, here also for the package).
#
# What it changes outside the clone: apt-installs libgtest-dev if GoogleTest is missing (sudo),
# and pip-installs into the current Python environment the pinned test and style tools (torch,
# numpy, pytest, hypothesis, nanobind, scikit-build-core, ninja, ruff, clang-format, mypy) and
# gdn itself. Inside the clone it writes build/ (a few hundred MB with CUDA: build/<wheel tag>/
# for the package, build/ctest/ for the C++ tests); delete it when done.
set -euo pipefail
cd "$(dirname "$0")/.."

# System GoogleTest (offline-friendly: found with find_package(GTest CONFIG), never downloaded).
if [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] && \
   [ ! -f /usr/lib/cmake/GTest/GTestConfig.cmake ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev
fi

python3 -m pip install -q "torch==2.13.0" "numpy>=1.23" "pytest>=7" "hypothesis>=6" \
  "nanobind==3.1.0" "scikit-build-core==1.1.2" ninja "ruff==0.17.6" "clang-format==23.1.5" \
  "mypy==2.4.1"
jobs=$(nproc 2>/dev/null || echo 2)

# Style: ruff (pyproject.toml: check and format) on the Python sources, clang-format
# (.clang-format) on the C++ and CUDA sources; both only check, they never rewrite.
python3 -m ruff check python tests benchmarks examples
python3 -m ruff format --check python tests benchmarks examples
git ls-files 'include/*' 'src/*' 'tests/cpp/*' 'examples/*' | grep -E '\.(hpp|cuh|cu|cpp)$' |
  xargs clang-format --dry-run --Werror

# Python package (with the CUDA kernels when nvcc is present, GPU or not: CI compiles them).
start=$(date +%s)
GDN_ENABLE_CUDA=${GDN_ENABLE_CUDA:-AUTO} CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
  python3 -m pip install -q --no-build-isolation --no-deps .
echo "package built in $(( $(date +%s) - start )) s"

# Types: mypy (pyproject.toml) on python/gdn, which reads gdn._C's types from the stub (_C.pyi)
# the install above generated.
python3 -m mypy

# C++ tests. The wheel above already compiles every architecture and kernel image; here one
# architecture, without replay's images for bf16 activations (the same kernel code at another
# template flag), is enough to prove the device tests compile.
start=$(date +%s)
cmake -S . -B build/ctest -G Ninja -DGDN_BUILD_TESTS=ON -DGDN_BF16_ACTIVATION_IMAGES=OFF \
  -DGDN_CUDA_ARCHITECTURES="${GDN_TEST_CUDA_ARCHITECTURES:-90a}" >/dev/null
cmake --build build/ctest -j "$jobs"
echo "C++ tests built in $(( $(date +%s) - start )) s"
(cd build/ctest && ctest --output-on-failure --no-tests=error -j "$jobs") | tee build/ctest/ctest.log
# ctest's summary counts a skipped test as passed; say how many were skipped.
echo "ctest: $(grep -c '(Skipped)$' build/ctest/ctest.log || true) of the tests above skipped"
if [ -x build/ctest/tests/cpp/gdn_gpu_tests ]; then  # say why device tests were skipped, if they were
  build/ctest/tests/cpp/gdn_gpu_tests 2>&1 | grep -A1 -E ": Skipped$" | grep -v -E "Skipped$|^--" | sort | uniq -c || true
fi

# Python tests, against the installed package (run from the tests dir so the source tree's
# python/ folder is never imported instead).
python3 -m pytest -q -ra tests/py
