#!/usr/bin/env bash
# Installs what is needed and runs gradzip's main job: the convergence harness's cpu-default suite
# (a ViT/14 depth model, 4 simulated workers, every codec with and without error feedback), which
# prints accuracy vs bytes on the wire at the end. Idempotent: a rerun resumes/skips finished runs.
#   bash scripts/run.sh [extra arguments for python -m gradzip.converge]
#   e.g. bash scripts/run.sh --suite cpu-smoke --out out/smoke
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=$(bash scripts/setup.sh | tail -n1)
export PATH="$VENV/bin:$PATH"
python -m pip install -q --no-build-isolation .
if (($#)); then
  exec python -m gradzip.converge "$@"
fi
exec python -m gradzip.converge --suite cpu-default --out out/cpu-default
