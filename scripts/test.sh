#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh) and runs every test of gradzip. Idempotent; this is
# what CI runs (.ci/run).
#   bash scripts/test.sh
# Stages:
#   0. ruff over the Python (pyproject.toml's [tool.ruff])
#   1. C++ build (CUDA kernels compiled for sm_80/sm_90 when nvcc is present, warnings as errors)
#      and CTest: CPU codec properties, exhaustive casts, corrupt payloads; GPU tests skip (77)
#      without a GPU
#   2. the installed CMake package, consumed by a separate project (tests/consumer); the compressed
#      all-reduce over c10d from C++ alone (2 processes, ProcessGroupGloo; tests/torch)
#   3. the C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer
#   4. libFuzzer: every decoder, the spec parser and a round trip, 60 s each (GRADZIP_FUZZ_SECONDS)
#   5. the Python package (pip install of the torch extension) and the convergence harness
#      (bench/harness), and pytest: ops, DDP hook on multi-process Gloo, the harness (incl. a
#      cpu-smoke run), cost model, netns smoke
#      (on a host with AVX-512, the training tests again as an AVX2 host computes them)
#   6. the notebooks, executed top to bottom
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=$(bash scripts/setup.sh | tail -n1)
export PATH="$VENV/bin:$PATH"
jobs=$(nproc)
# cmake --build and ctest, also inside `cmake --workflow`, take their parallelism from these.
export CMAKE_BUILD_PARALLEL_LEVEL=$jobs CTEST_PARALLEL_LEVEL=$jobs
build=build/release  # the release preset's binaryDir; the build trees' settings: CMakePresets.json
t0=$SECONDS
stage() { echo; echo "== [$((SECONDS - t0)) s] $*"; }

stage "Python: ruff check (rules in pyproject.toml)"
ruff check .

stage "C++: configure, build, CTest"
cmake --workflow --preset release

stage "C++: install the package and build a consumer project against it"
prefix="$PWD/$build/install"
cmake --install "$build" --prefix "$prefix" >/dev/null
cmake -S tests/consumer -B "$build/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build/consumer"
"$build/consumer/gradzip_consumer"

stage "C++ over c10d: the compressed all-reduce from libtorch, 2 processes on ProcessGroupGloo"
# Not a workflow: configuring takes the venv's interpreter, which differs per machine, as -D.
cmake --preset torch -DPython3_EXECUTABLE="$(command -v python)" >/dev/null
cmake --build --preset torch
ctest --preset torch

stage "C++ under ASan + UBSan"
bash scripts/sanitize.sh

stage "libFuzzer, ${GRADZIP_FUZZ_SECONDS:-60} s per target"
bash scripts/fuzz.sh "${GRADZIP_FUZZ_SECONDS:-60}"

stage "Python: build + install the package (torch extension) and the harness, pytest"
bash scripts/install.sh  # the library and the harness (bench/harness)
python -m pytest -q -rs tests/python

# A claim about training (pytest -m training) holds on every x86 host, not just on this one: torch's
# CPU kernels round differently per instruction set (ATen's dispatch and oneDNN's matmuls; MKL is
# pinned too), so an AVX-512 host reruns those tests with every library held to AVX2. On an AVX2
# host the run above was that run already.
if grep -qw avx512f /proc/cpuinfo; then
  stage "Python: the training tests again with torch, oneDNN, MKL and gradzip held to AVX2"
  ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 GRADZIP_CPU_ISA=avx2 \
    python -m pytest -q -rs -m training tests/python
fi

stage "Notebooks"
bash scripts/notebooks.sh build/notebooks

stage "all stages passed"
