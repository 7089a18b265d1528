#!/usr/bin/env bash
# Runs every libFuzzer target of a clang GRADZIP_FUZZ=ON build for a bounded time.
#   bash tests/fuzz/run.sh BUILD_DIR [SECONDS]        (default: 60 seconds per target)
# (scripts/fuzz.sh configures and builds BUILD_DIR first.)
# Per target: replays tests/fuzz/regressions/<target>/ (inputs that once crashed), then fuzzes
# for SECONDS starting from the checked-in seeds tests/fuzz/corpus/<target>/ (new inputs go to
# BUILD_DIR/fuzz-work/<target>/corpus; the checked-in corpus is never modified). Any crash, leak,
# hang (> 10 s on one input), sanitizer report or failed property check fails the run; libFuzzer
# saves the input as BUILD_DIR/fuzz-work/<target>/crash-* (or leak-*, timeout-*): once the bug is
# fixed, copy it into tests/fuzz/regressions/<target>/ so it is replayed forever.
# GRADZIP_FUZZ_KEEP_GOING=1: fuzz in libFuzzer's fork mode and keep going after a failure, so that
# one run collects every distinct failing input (triage); the run still fails.
set -uo pipefail
build=${1:?usage: tests/fuzz/run.sh BUILD_DIR [SECONDS]}
seconds=${2:-60}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
targets=(decode decode_add read_header spec roundtrip)

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
flags=(-detect_leaks=1 -timeout=10 -rss_limit_mb=4096 -print_final_stats=1)
report='ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|FUZZ CHECK FAILED|SUMMARY: UndefinedBehaviorSanitizer'

dict_of() {
  case $1 in
    spec) echo "$here/spec.dict" ;;
    decode|decode_add|read_header) echo "$here/wire.dict" ;;
  esac
}

failed=()
summary=()
for t in "${targets[@]}"; do
  bin=$build/tests/fuzz/fuzz_$t
  if [[ ! -x $bin ]]; then
    echo "run.sh: $bin is missing (build target gradzip_fuzzers with clang, GRADZIP_FUZZ=ON)" >&2
    exit 2
  fi
  work=$build/fuzz-work/$t
  rm -rf "$work" && mkdir -p "$work/corpus"

  # 1. Regressions: each file runs once.
  mapfile -t regress < <(find "$here/regressions/$t" -type f ! -name '*.md' 2>/dev/null | sort)
  if ((${#regress[@]})); then
    if ! "$bin" "${flags[@]}" "${regress[@]}" >"$work/regressions.log" 2>&1 ||
        grep -qE "$report" "$work/regressions.log"; then
      echo "== $t: a regression input fails again:"; tail -n 40 "$work/regressions.log"
      failed+=("$t(regression)")
    fi
  fi

  # 2. Fuzz for a bounded time from the seeds.
  dict=$(dict_of "$t")
  start=$(date +%s)
  mode=()
  [[ ${GRADZIP_FUZZ_KEEP_GOING:-0} == 1 ]] && mode=(-fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1)
  "$bin" "${flags[@]}" "${mode[@]}" -max_total_time="$seconds" -artifact_prefix="$work/" \
    ${dict:+-dict="$dict"} "$work/corpus" "$here/corpus/$t" >"$work/fuzz.log" 2>&1
  rc=$?
  elapsed=$(($(date +%s) - start))
  # Executions: the final stats line; in fork mode the last "#N:" progress line.
  execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$work/fuzz.log" | tail -n1)
  [[ -z $execs ]] && execs=$(grep -oE '^#[0-9]+' "$work/fuzz.log" | tail -n1 | tr -d '#')
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$work/fuzz.log" | tail -n1)
  artifacts=$(find "$work" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | sort)
  status=ok
  if ((rc != 0)) || [[ -n $artifacts ]] || grep -qE "$report" "$work/fuzz.log"; then
    status=FAILED
    failed+=("$t")
    echo "== $t: FAILED (exit $rc); log $work/fuzz.log; failing input(s):"
    echo "$artifacts"
    grep -m1 -B2 -A30 -E "$report" "$work/fuzz.log" || tail -n 40 "$work/fuzz.log"
  fi
  line=$(printf 'fuzz %-12s %-6s %10s execs in %3ss  regressions %d  failing inputs %d  %s' \
    "$t" "$status" "${execs:-?}" "$elapsed" "${#regress[@]}" "$(grep -c . <<<"$artifacts")" "$cov")
  echo "$line"
  summary+=("$line")
done

echo "== fuzz summary (${seconds}s per target)"
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "FUZZ FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: all targets clean"
