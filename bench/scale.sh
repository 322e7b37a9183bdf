#!/usr/bin/env bash
# Scale check: one router holding N concurrent open streams from slow
# decode simulators. Each simulator and the router run as processes of
# their own, so that every process stays within its open-file limit (the
# router holds two sockets per open stream: the client's and the decode
# engine's). Prints the bench report, with the router's CPU per request and
# its resident memory per open stream.
#
# Usage: bench/scale.sh [STREAMS] [SECONDS]   (defaults 9500, 30)
set -euo pipefail
cd "$(dirname "$0")/.."
streams="${1:-9500}"
secs="${2:-30}"
work=$(mktemp -d)
bin="$work/narwhal"
go build -o "$bin" ./cmd/narwhal
pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  if [ -n "${KEEP_LOGS:-}" ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
cfg="$work/router.yaml"
{
  echo "engine: {first_token_timeout_s: 60, decode_read_timeout_s: 30, prefill_timeout_s: 60}"
  echo "router: {log_level: warn}"
  echo "fleet:"
} > "$cfg"
for e in p1:prefill p2:prefill d1:decode d2:decode; do
  id=${e%%:*}; role=${e##*:}; p=$(port)
  "$bin" sim --role "$role" --listen "127.0.0.1:$p" --engine-id "$id" --model scale-model \
    --ttft 200ms --itl 1s > "$work/$id.log" 2>&1 &
  pids+=($!)
  echo "  - {id: $id, url: \"http://127.0.0.1:$p\", role: $role}" >> "$cfg"
done
rp=$(port)
admin=()
if [ -n "${ADMIN:-}" ]; then admin=(--admin "$ADMIN"); fi # e.g. ADMIN=127.0.0.1:6060 for /debug/pprof
"$bin" router --config "$cfg" --listen "127.0.0.1:$rp" "${admin[@]}" > "$work/router.log" 2>&1 &
rpid=$!
pids+=($rpid)
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$rp/readyz" >/dev/null && break
  sleep 0.1
done
echo "router pid $rpid, $(grep -c processor /proc/cpuinfo) CPUs, open-file limit $(ulimit -n)"
"$bin" bench --url "http://127.0.0.1:$rp" --router-pid "$rpid" --concurrency "$streams" \
  --max-tokens 20 --duration "${secs}s" --warmup 25s --timeout 120s --quiet \
  --json bench/results/scale.json
