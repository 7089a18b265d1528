#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan, coverage-instrumented library) and runs
# each for a bounded time; fails on any crash, leak, hang or sanitizer report.
#   bash scripts/fuzz.sh [SECONDS]          (default 60 per target; build dir: build/fuzz,
#                                            or $GRADZIP_FUZZ_BUILD_DIR)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${GRADZIP_FUZZ_BUILD_DIR:-build/fuzz}
jobs=${JOBS:-$(nproc)}

# RelWithDebInfo without -DNDEBUG: optimised, with line numbers and the library's asserts on.
cmake --preset fuzz -B "$build" >/dev/null  # CMakePresets.json
cmake --build "$build" -j "$jobs" --target gradzip_fuzzers
exec bash tests/fuzz/run.sh "$build" "${1:-60}"
