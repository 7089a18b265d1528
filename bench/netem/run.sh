#!/usr/bin/env bash
# Real scarce-bandwidth benchmark: 2-rank DDP training over a shaped link between two network
# namespaces, once per communication hook (hooks named fsdp-none, fsdp-torch-bf16, fsdp-CODEC:
# FSDP2 training with FSDP's own or gradzip's compressed reduce-scatter; fsdp-CODEC+params=PCODEC:
# and gradzip's compressed parameter all-gather; local:CODEC:H: no DDP, every rank its own replica
# synced every H steps by gradzip.local_steps; two-level:CODEC: gradzip.two_level's reduction, exact
# inside a namespace and CODEC between them; --model lm-s: the harness's language model; see
# driver.py). --ranks-per-node R: R ranks in each namespace (two "nodes" of R ranks, the ranks of
# one node talking over its own unshaped loopback), 2R ranks in all.
#
#   bench/netem/run.sh --rate 1gbit --out DIR [--delay 1ms] [--model vit-s14] [--size 56]
#                      [--batch 1] [--steps 8] [--warmup 3] [--threads 1] [--hooks LIST]
#                      [--guard-nonfinite] [--time-limit SECONDS] [--ranks-per-node R]
#
# Creates namespaces gzne0-PID and gzne1-PID joined by a veth pair (10.244.77.1/.2, addresses that
# exist only inside the namespaces), shapes both directions with tc (tbf at --rate; netem in front
# with --delay), then for each hook runs rank 0 in one namespace and rank 1 in the other (Gloo,
# MASTER_ADDR = rank 0's veth address) and finally a single process with no communication. Hook
# `nocomm` (a hook that sends nothing) measures the floor any hook can reach with two ranks here.
# Writes DIR/results.csv (hook,step_time_s_median,bytes_per_step,speedup_vs_allreduce),
# DIR/results.md (with the cost model's predictions beside the measurements), DIR/costmodel.csv,
# per-rank JSON in DIR/raw and logs in DIR/logs. The namespaces are removed on any exit
# (success, failure, Ctrl-C, TERM). Needs root, ip and tc (iproute2); exits 2 without them.
# Runs the installed `gradzip` and `gradzip_converge` (bench/harness) packages with $PYTHON (default:
# python3 on PATH).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "netem: $*" >&2; exit 2; }
usage() { { echo "usage:"; sed -n "9,12p" "${BASH_SOURCE[0]}" | sed "s/^# \{0,1\}/  /"; } >&2; exit 2; }

rate="" out="" delay="" model=vit-s14 size=56 batch=1 steps=8 warmup=3 threads=1 guard=()
hooks="none,torch-fp16,torch-bf16,powersgd:2,bf16,int8,sign,topk:0.01,nocomm"
time_limit=780
ranks_per_node=1
python="${PYTHON:-python3}"
while (($#)); do
  case "$1" in
    --rate) rate="${2:-}"; shift 2 ;;
    --out) out="${2:-}"; shift 2 ;;
    --delay) delay="${2:-}"; shift 2 ;;
    --model) model="${2:-}"; shift 2 ;;
    --size) size="${2:-}"; shift 2 ;;
    --batch) batch="${2:-}"; shift 2 ;;
    --steps) steps="${2:-}"; shift 2 ;;
    --warmup) warmup="${2:-}"; shift 2 ;;
    --threads) threads="${2:-}"; shift 2 ;;
    --hooks) hooks="${2:-}"; shift 2 ;;
    --guard-nonfinite) guard=(--guard-nonfinite); shift ;;
    --time-limit) time_limit="${2:-}"; shift 2 ;;
    --ranks-per-node) ranks_per_node="${2:-}"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "netem: unknown argument $1" >&2; usage ;;
  esac
done
[[ -n "$rate" && -n "$out" ]] || usage
[[ "$rate" =~ ^[0-9]+(\.[0-9]+)?[kmg]bit$ ]] || die "--rate $rate: expected e.g. 1gbit, 500mbit"
[[ -z "$delay" || "$delay" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || die "--delay $delay: expected e.g. 1ms"
for v in size batch steps warmup threads time_limit ranks_per_node; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "--${v//_/-} must be a positive integer"
done

# --- requirements: clear messages, exit 2 ---------------------------------------------------------
"$python" -c "import torch, gradzip_converge.models" 2>/dev/null ||
  die "$python cannot import torch and gradzip_converge (install gradzip and bench/harness into this Python, or set PYTHON)"
"$python" "$here/driver.py" check-hooks "$hooks" || die "bad --hooks $hooks"
if [[ ",$hooks," =~ ,(bf16|fp16|fp32|int8|sign|topk)[:,] ]]; then
  "$python" -c "import gradzip.ddp" 2>/dev/null ||
    die "$python cannot import gradzip.ddp, needed by the gradzip hooks in --hooks $hooks"
fi
if [[ ",$hooks," == *,local:* ]]; then
  "$python" -c "import gradzip.local_steps" 2>/dev/null ||
    die "$python cannot import gradzip.local_steps, needed by the local:* hooks in --hooks $hooks"
fi
if [[ ",$hooks," == *,two-level:* ]]; then
  "$python" -c "import gradzip.two_level" 2>/dev/null ||
    die "$python cannot import gradzip.two_level, needed by the two-level:* hooks in --hooks $hooks"
fi
if [[ ",$hooks," == *,fsdp-* ]]; then
  "$python" -c "import gradzip.fsdp" 2>/dev/null ||
    die "$python cannot import gradzip.fsdp, needed by the fsdp-* hooks in --hooks $hooks"
fi

[[ $(id -u) -eq 0 ]] || die "needs root (creates network namespaces and tc qdiscs); run with sudo"
for tool in ip tc timeout; do
  command -v "$tool" >/dev/null || die "'$tool' not found (install iproute2 / coreutils: scripts/setup.sh)"
done

# --- namespaces, cleaned up on every exit ---------------------------------------------------------
ns0="gzne0-$$" ns1="gzne1-$$" v0="gzv0-$$" v1="gzv1-$$"
ip0=10.244.77.1 ip1=10.244.77.2
pids=()
cleaned=0
cleanup() {
  local rc=$?
  ((cleaned)) && return
  cleaned=1
  trap - EXIT INT TERM ERR
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for ns in "$ns0" "$ns1"; do
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || echo "netem: could not delete namespace $ns" >&2
    fi
  done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit $?' ERR

ip netns add "$ns0" 2>/dev/null || die "'ip netns add' is not permitted here (no CAP_SYS_ADMIN?)"
ip netns add "$ns1"
ip link add "$v0" netns "$ns0" type veth peer name "$v1" netns "$ns1"
ip -n "$ns0" addr add "$ip0/24" dev "$v0"
ip -n "$ns1" addr add "$ip1/24" dev "$v1"
for pair in "$ns0:$v0" "$ns1:$v1"; do
  ns=${pair%%:*} dev=${pair#*:}
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$dev" up
  # tbf's bucket must hold a timer tick of traffic at the rate: 4 ms worth, at least 64 KiB.
  burst=$(awk -v r="$rate" 'BEGIN { u = substr(r, length(r) - 3, 1); v = r + 0;
    s = (u == "g") ? 1e9 : (u == "m") ? 1e6 : 1e3; b = v * s / 8 * 0.004;
    printf "%d", (b < 65536) ? 65536 : b }')
  if [[ -n "$delay" ]]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000 ||
      die "tc cannot add a netem qdisc (kernel without sch_netem?): run without --delay"
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "$rate" burst "$burst" latency 200ms
  else
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst "$burst" latency 200ms
  fi
done

mkdir -p "$out/raw" "$out/logs"
rm -f "$out"/raw/*.json
echo "bench/netem/run.sh --rate $rate --out $out${delay:+ --delay $delay} --model $model --size $size --batch $batch --steps $steps --warmup $warmup --threads $threads --hooks $hooks${guard:+ --guard-nonfinite} --ranks-per-node $ranks_per_node" >"$out/command.txt"
ip netns exec "$ns0" tc -s qdisc show dev "$v0" >"$out/logs/qdisc.txt"

common=(--model "$model" --size "$size" --batch "$batch" --steps "$steps" --warmup "$warmup" --threads "$threads")
deadline=$((SECONDS + time_limit))
per_hook_max=$((time_limit / 3 > 60 ? time_limit / 3 : 60))

world=$((2 * ranks_per_node))

# Runs every rank of one hook (ranks 0..R-1 in the first namespace, R..2R-1 in the second); a rank
# that fails takes the others down at once.
run_hook() {
  local i=$1 hook=$2 safe=${2//:/_}
  local left=$((deadline - SECONDS - 30))
  ((left > 20)) || { echo "netem: $hook skipped: --time-limit reached" >&2; return 1; }
  local t=$((left < per_hook_max ? left : per_hook_max))
  local port=$((29500 + i))
  local -a rp=()
  for ((r = 0; r < world; r++)); do
    local ns=$ns0 dev=$v0
    ((r < ranks_per_node)) || { ns=$ns1; dev=$v1; }
    timeout -k 5 "$t" ip netns exec "$ns" "$python" "$here/driver.py" rank --rank "$r" \
      --world "$world" --ranks-per-node "$ranks_per_node" \
      --addr "$ip0" --port "$port" --ifname "$dev" --hook "$hook" --timeout "$t" \
      --json "$out/raw/$safe.rank$r.json" "${common[@]}" "${guard[@]}" >"$out/logs/$safe.rank$r.log" 2>&1 &
    rp+=($!)
    pids+=($!)
  done
  local rc=0 first=""
  wait -n -p first "${rp[@]}" || { rc=1; kill "${rp[@]}" 2>/dev/null || true; }
  for p in "${rp[@]}"; do [[ "$p" == "$first" ]] || wait "$p" || rc=1; done
  pids=()
  if ((rc)); then
    echo "netem: $hook FAILED; last lines of its logs:" >&2
    for ((r = 0; r < world; r++)); do tail -n 5 "$out/logs/$safe.rank$r.log" >&2 || true; done
  else
    echo "netem: $hook done" >&2
  fi
  return $rc
}

failed=0
i=0
IFS=, read -ra hook_list <<<"$hooks"
for hook in "${hook_list[@]}"; do
  run_hook "$i" "$hook" || failed=1
  i=$((i + 1))
done
left=$((deadline - SECONDS))
((left > 10)) || die "--time-limit reached before the no-communication run"
timeout -k 5 "$left" ip netns exec "$ns0" "$python" "$here/driver.py" single \
  --json "$out/raw/single.json" "${common[@]}" >"$out/logs/single.log" 2>&1 || failed=1
ip netns exec "$ns0" tc -s qdisc show dev "$v0" >>"$out/logs/qdisc.txt"

"$python" "$here/driver.py" report --dir "$out" --rate "$rate" ${delay:+--delay "$delay"} \
  --hooks "$hooks" --world "$world" || failed=1
exit $failed
