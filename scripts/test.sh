#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh) and runs every test of gradzip. Idempotent.
#   bash scripts/test.sh
# Stages: C++ build (CUDA compiled when nvcc is present) + CTest; the installed CMake package
# consumed by a separate project.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=$(bash scripts/setup.sh | tail -n1)
export PATH="$VENV/bin:$PATH"
jobs=$(nproc)
build=${GRADZIP_BUILD_DIR:-build/test}

echo "== C++: configure, build, CTest"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADZIP_WERROR=ON >/dev/null
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"

echo "== C++: install the package and build a consumer project against it"
prefix="$build/install"
cmake --install "$build" --prefix "$prefix" >/dev/null
cmake -S tests/consumer -B "$build/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$PWD/$prefix" >/dev/null
cmake --build "$build/consumer"
"$build/consumer/gradzip_consumer"
