#!/usr/bin/env bash
# Executes every notebook in notebooks/ top to bottom (on the small result files in notebooks/data/),
# so that they cannot rot. The executed copies go to $OUT (default build/notebooks); the notebooks
# in the repository stay without outputs. Needs the gradzip package and the convergence harness
# (bench/harness) installed in the Python on PATH.
#   bash scripts/notebooks.sh [OUT]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-build/notebooks}"
mkdir -p "$out"
python="${PYTHON:-python}"
status=0
for nb in notebooks/*.ipynb; do
  echo "== notebook $nb"
  if ! "$python" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=600 \
      --ExecutePreprocessor.kernel_name=python3 --output-dir "$out" "$nb"; then
    echo "notebooks: $nb failed" >&2
    status=1
  fi
done
exit $status
