#!/usr/bin/env bash
# Installs everything gradzip needs on a fresh Debian machine, idempotently:
#   - Debian packages (compiler, CMake, GoogleTest, Google Benchmark, clang + libFuzzer, iproute2)
#   - a Python venv with the pinned packages of requirements.txt, kept OUTSIDE the clone at
#     $GRADZIP_VENV (default ~/.cache/gradzip/venv-<hash of requirements.txt>) so that a fresh
#     clone finds it again and a rerun costs seconds.
# Prints the venv path on its last line. Usage: VENV=$(bash scripts/setup.sh | tail -n1)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# libgloo-dev: declarations of the gloo types that ProcessGroupGloo.hpp names (C++ test over c10d)
debs=(build-essential cmake ninja-build libgtest-dev libgmock-dev libbenchmark-dev clang libclang-rt-14-dev llvm iproute2 python3-venv libgloo-dev)
missing=()
for p in "${debs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

req="$here/requirements.txt"
hash=$(sha256sum "$req" | cut -c1-12)
venv="${GRADZIP_VENV:-$HOME/.cache/gradzip/venv-$hash}"
mkdir -p "$(dirname "$venv")"
# Two setups at once (parallel checkouts) would delete each other's half-built venv: take turns.
exec 9>"$venv.lock"
flock 9
if [[ ! -f "$venv/.complete" ]]; then
  echo "setup: creating Python venv $venv (first run downloads PyTorch, several GB)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$req" >&2
  touch "$venv/.complete"
fi
# Tools only the checks use, kept out of requirements.txt so that adding one does not rebuild the
# venv (named after that file's hash). A pinned version already there costs no download.
# accelerate: a client the tests run (docs/guide.md's Hugging Face Accelerate example), pinned here
# like the checkers, not an extra: gradzip does not import it.
"$venv/bin/python" -m pip install -q "ruff==0.17.5" "accelerate==1.15.0" >&2
# setuptools builds the convergence harness (bench/harness) without build isolation. A venv of
# Python 3.12+ comes without it, 3.11's with one that would also need `wheel`; installed here, like
# the tools above, so that requirements.txt (and with it the venv's name) stays as it is.
"$venv/bin/python" -m pip install -q "setuptools==80.9.0" >&2
echo "$venv"
