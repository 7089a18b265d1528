#!/usr/bin/env bash
# Installs what is needed and runs gradzip's main job: the convergence harness's cpu-default suite
# (a ViT/14 depth model, 4 simulated workers, every codec with and without error feedback), which
# prints accuracy vs bytes on the wire at the end. Idempotent: a rerun resumes/skips finished runs.
# Without arguments: cpu-default, seed 0, two runs at a time (one per core; about 15-20 minutes on
# 2 cores). With arguments, they replace those defaults and go to the harness as they are.
#   bash scripts/run.sh [arguments for python -m gradzip_converge]
#   e.g. bash scripts/run.sh --suite cpu-smoke --out out/smoke
#        bash scripts/run.sh --suite cpu-default --out out/cpu-default-5 --seeds 5 --jobs 2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=$(bash scripts/setup.sh | tail -n1)
export PATH="$VENV/bin:$PATH"
bash scripts/install.sh  # the library and the harness (bench/harness)
if (($#)); then
  exec python -m gradzip_converge "$@"
fi
exec python -m gradzip_converge --suite cpu-default --out out/cpu-default --jobs 2
