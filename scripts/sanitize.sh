#!/usr/bin/env bash
# Builds the C++ tests with AddressSanitizer + UndefinedBehaviorSanitizer and runs them (CTest);
# any sanitizer report fails. The fuzz targets are built too (as replayers with g++) so the seed
# corpus and every regression input run under the sanitizers as well.
#   bash scripts/sanitize.sh                (build dir: build/asan, or $GRADZIP_ASAN_BUILD_DIR;
#                                            compiler: $CXX, default g++; JOBS: parallelism)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${GRADZIP_ASAN_BUILD_DIR:-build/asan}
jobs=${JOBS:-$(nproc)}

# RelWithDebInfo without -DNDEBUG: asserts stay on; -O1 keeps ASan stack traces exact enough
# while the 1M-element tests stay fast.
cmake --preset asan -B "$build" ${CXX:+-DCMAKE_CXX_COMPILER="$CXX"} >/dev/null  # CMakePresets.json
cmake --build "$build" -j "$jobs"

# Every report is fatal (GRADZIP_SANITIZE also compiles with -fno-sanitize-recover=all).
export ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1
# The exhaustive 2^32-input cast tests (*AllFloats*) check arithmetic, not memory: ~20 CPU-minutes
# under ASan for nothing the other tests do not cover; they run in the plain build
# (scripts/test.sh). GRADZIP_SANITIZE_EXCLUDE='' runs them too.
exclude=${GRADZIP_SANITIZE_EXCLUDE-AllFloats}
ctest --test-dir "$build" --output-on-failure -j "$jobs" ${exclude:+-E "$exclude"}
# A report printed by a test that still exits 0 (e.g. inside a child process) fails too.
if grep -nE 'ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:' \
    "$build/Testing/Temporary/LastTest.log"; then
  echo "sanitize.sh: sanitizer report in the test log (above)" >&2
  exit 1
fi
echo "sanitize: all tests clean under ASan + UBSan"
