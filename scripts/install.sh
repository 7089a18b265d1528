#!/usr/bin/env bash
# Builds and installs this checkout's gradzip and its convergence harness (bench/harness, a
# distribution of its own) into the Python on PATH, in one resolution: the harness's `gradzip`
# requirement is the checkout's, not one looked up on the package index. Without build isolation
# (an isolated build would download another torch). setuptools builds the harness in its folder and
# never deletes from build/lib, so a module removed from the harness would still be installed from
# an earlier build: that folder goes first.
#   PATH="$VENV/bin:$PATH" bash scripts/install.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf bench/harness/build
python -m pip install -q --no-build-isolation . ./bench/harness
