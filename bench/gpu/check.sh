#!/usr/bin/env bash
# The device check, for a GPU machine that has CUDA 13, PyTorch and CMake but no
# GoogleTest and no internet: runs the GPU tests, the kernel benchmark and PyTorch's ops with
# binaries built elsewhere (bench/gpu/README.md), and writes OUTDIR/RESULTS.md + the raw JSON.
# Budget: under 9 minutes on one H200 in the worst case (each stage has its own timeout:
# tests 180 s, sanitizers 3 x 40 s, benchmark 150 s, PyTorch ops 80 s).
#   bench/gpu/check.sh OUTDIR        (GRADZIP_BUILD_DIR: the build folder, default build/gpu;
#                                     PYTHON: an interpreter with torch, default python3)
set -uo pipefail
out=${1:?usage: bench/gpu/check.sh OUTDIR}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${GRADZIP_BUILD_DIR:-$root/build/gpu}
python=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Shared libraries copied at build time (libbenchmark, libgomp, libstdc++): see copy_runtime.cmake.
export LD_LIBRARY_PATH="$build/gpu-runtime${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
failed=0

echo "== device"
nvidia-smi 2>&1 | tee "$out/nvidia-smi.txt" | head -15

echo "== GPU tests (CPU vs GPU bytes, corrupt payloads)"
timeout 180 "$build/tests/gpu/gradzip_gpu_tests" --gtest_output="json:$out/gpu_tests.json" \
  >"$out/gpu_tests.log" 2>&1
rc=$?
tail -n 25 "$out/gpu_tests.log"
echo "gpu tests: exit $rc"
[ "$rc" -eq 0 ] || failed=1

echo "== compute-sanitizer: memcheck, racecheck, initcheck on the GPU tests, sizes <= 4099"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck initcheck; do
  GRADZIP_GPU_TEST_MAX_N=4099 timeout 40 "$sanitizer" --tool "$tool" --error-exitcode 3 \
    "$build/tests/gpu/gradzip_gpu_tests" >"$out/sanitizer_$tool.log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool: exit $rc ($(grep -c '^========= [A-Z]' "$out/sanitizer_$tool.log") report lines; $out/sanitizer_$tool.log)"
  [ "$rc" -eq 0 ] || failed=1
done

echo "== kernel benchmark (CUDA events, D2D copy baseline)"
timeout 150 "$build/bench/gpu/gradzip_gpu_bench" --benchmark_min_time=0.05 \
  --benchmark_out="$out/bench.json" --benchmark_out_format=json >"$out/bench.log" 2>&1
rc=$?
tail -n 5 "$out/bench.log"
echo "benchmark: exit $rc"
[ "$rc" -eq 0 ] || failed=1

echo "== PyTorch ops on the same GPU"
timeout 80 "$python" "$root/bench/gpu/torch_ops.py" --out "$out/torch_ops.json" >"$out/torch_ops.log" 2>&1
rc=$?
tail -n 3 "$out/torch_ops.log"
echo "torch ops: exit $rc"
[ "$rc" -eq 0 ] || failed=1

"$python" "$root/bench/gpu/report.py" --bench "$out/bench.json" --torch "$out/torch_ops.json" \
  --tests "$out/gpu_tests.json" >"$out/RESULTS.md"
cat "$out/RESULTS.md"
exit $failed
