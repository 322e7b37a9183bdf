#!/usr/bin/env bash
# A Narwhal mesh on this machine: a bus (NATS with JetStream) with one
# credential per role and one per engine and router, a breaker, two routers and four simulators (two
# prefill, two decode) that register themselves in the live fleet; the
# routers' and the breaker's settings are examples/mesh-fleet.yaml. It
# prints what to curl and what to watch; Ctrl-C stops everything, one
# line per process (the end of its log only for one that failed).
#
#   examples/mesh.sh            (or: just mesh)
#
# Environment (all optional):
#   MESH_BIN           the narwhal binary (default bin/narwhal, built when missing)
#   MESH_DIR           where the credentials, the bus's store and the logs go
#                      (default a new temporary directory, removed at the end)
#   MESH_BUS_PORT      the bus's port (default 4222)
#   MESH_ROUTER_PORTS  the two routers' ports (default "8081 8082")
#   MESH_SIM_PORTS     the four simulators' ports, p1 p2 d1 d2 (default "8101 8102 8103 8104")
#   MESH_READY_S       how long to wait for each process to be ready (default 30)
set -euo pipefail
# Job control: each process runs in a process group of its own, so a
# terminal's Ctrl-C reaches this script alone, which stops them in order.
set -m
cd "$(dirname "$0")/.."

bin=${MESH_BIN:-bin/narwhal}
bus_port=${MESH_BUS_PORT:-4222}
read -r -a router_ports <<<"${MESH_ROUTER_PORTS:-8081 8082}"
read -r -a sim_ports <<<"${MESH_SIM_PORTS:-8101 8102 8103 8104}"
ready_s=${MESH_READY_S:-30}
model=narwhal-sim
if [ "${#router_ports[@]}" -ne 2 ] || [ "${#sim_ports[@]}" -ne 4 ]; then
  echo "mesh: MESH_ROUTER_PORTS needs 2 ports and MESH_SIM_PORTS 4" >&2
  exit 2
fi
if ! command -v curl >/dev/null; then
  echo "mesh: curl is needed (apt-get install curl)" >&2
  exit 1
fi

if [ ! -x "$bin" ]; then
  echo "building $bin (the first build takes a minute) ..."
  go build -o "$bin" ./cmd/narwhal
fi

own_dir=
dir=${MESH_DIR:-}
if [ -z "$dir" ]; then
  dir=$(mktemp -d "${TMPDIR:-/tmp}/narwhal-mesh.XXXXXX")
  own_dir=1
fi
mkdir -p "$dir"

pids=()
names=()
stopping=
# stop ends every process, the last started first (routers and the
# breaker before the simulators, the bus last, so that the routers' last
# events reach it), waits for each and says in one line how it ended; the
# end of the log of one that failed (a status other than 0, or 143 when
# SIGTERM came before its handler) follows its line, and the directory is
# then kept (and named). A second Ctrl-C meanwhile is ignored, so that the
# stop completes and the directory, which holds the credentials, goes.
stop() {
  trap '' INT TERM
  trap - EXIT
  stopping=1
  echo
  echo "stopping the mesh ..."
  local i status failed=
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null || true
    status=0
    wait "${pids[i]}" 2>/dev/null || status=$?
    if [ "$status" -eq 0 ] || [ "$status" -eq 143 ]; then
      printf '  %-8s stopped\n' "${names[i]}"
    else
      printf '  %-8s exited with status %d; the end of %s:\n' "${names[i]}" "$status" "$dir/${names[i]}.log"
      tail -n 20 "$dir/${names[i]}.log" | sed 's/^/    /'
      failed=1
    fi
  done
  echo "stopped"
  if [ -n "$own_dir" ] && [ -z "$failed" ]; then
    rm -rf "$dir"
  else
    echo "logs kept in $dir"
  fi
}
trap 'stop; exit 0' INT TERM
trap 'stop' EXIT

# start NAME ENV... -- ARGS...: runs "$bin ARGS..." in the background with
# ENV, its output in $dir/NAME.log.
start() {
  local name=$1
  shift
  local env=()
  while [ "$1" != "--" ]; do
    env+=("$1")
    shift
  done
  shift
  env "${env[@]}" "$bin" "$@" >"$dir/$name.log" 2>&1 &
  pids+=($!)
  names+=("$name")
}

# wait_for WHAT CMD...: runs CMD every 0.1 s until it succeeds; fails after
# $ready_s seconds, or when the last started process has exited (stop then
# shows the end of its log, once).
wait_for() {
  local what=$1
  shift
  local tries=$((ready_s * 10))
  until "$@" >/dev/null 2>&1; do
    local last=$((${#pids[@]} - 1))
    if ! kill -0 "${pids[last]}" 2>/dev/null; then
      echo "mesh: ${names[last]} exited before $what was ready" >&2
      if grep -q "already in use" "$dir/${names[last]}.log"; then
        echo "mesh: its port is taken: choose others with MESH_BUS_PORT, MESH_ROUTER_PORTS, MESH_SIM_PORTS" >&2
      fi
      exit 1
    fi
    tries=$((tries - 1))
    if [ "$tries" -le 0 ]; then
      echo "mesh: $what not ready after ${ready_s}s" >&2
      own_dir=
      exit 1
    fi
    sleep 0.1
  done
}

ready() { curl -fsS -o /dev/null --max-time 1 "$1"; }

fleet=examples/mesh-fleet.yaml

# One NATS credential per role, and one per engine and per router (each
# speaks only for itself); the bus enforces them.
creds=$dir/creds
if [ ! -e "$creds/auth.conf" ]; then
  "$bin" bus creds --out "$creds" >"$dir/creds.log"
fi
for id in p1 p2 d1 d2; do
  [ -e "$creds/engine-$id.creds" ] || "$bin" bus creds --out "$creds" --engine "$id" >>"$dir/creds.log"
done
for id in r1 r2; do
  [ -e "$creds/router-$id.creds" ] || "$bin" bus creds --out "$creds" --router "$id" >>"$dir/creds.log"
done
nats=nats://127.0.0.1:$bus_port

start bus -- bus --listen "127.0.0.1:$bus_port" --data "$dir/bus" --auth "$creds"
wait_for "the bus" grep -q "bus listening on" "$dir/bus.log"

ids=(p1 p2 d1 d2)
roles=(prefill prefill decode decode)
for i in 0 1 2 3; do
  start "${ids[i]}" NARWHAL_NATS_URL="$nats" NARWHAL_NATS_CREDS="$creds/engine-${ids[i]}.creds" -- \
    sim --role "${roles[i]}" --listen "127.0.0.1:${sim_ports[i]}" --engine-id "${ids[i]}" --model "$model" --register
done
for i in 0 1 2 3; do
  wait_for "simulator ${ids[i]}" ready "http://127.0.0.1:${sim_ports[i]}/health"
  wait_for "simulator ${ids[i]}'s registration" grep -q "registered ${ids[i]} " "$dir/${ids[i]}.log"
done

start breaker NARWHAL_NATS_URL="$nats" NARWHAL_NATS_CREDS="$creds/breaker.creds" -- breaker --config "$fleet"
for i in 0 1; do
  start "r$((i + 1))" NARWHAL_NATS_URL="$nats" NARWHAL_NATS_CREDS="$creds/router-r$((i + 1)).creds" NARWHAL_ROUTER_ID="r$((i + 1))" -- \
    router --config "$fleet" --listen "127.0.0.1:${router_ports[i]}"
  wait_for "router r$((i + 1))" ready "http://127.0.0.1:${router_ports[i]}/readyz"
done
# Ready once the breaker has checked every simulator and both routers may
# place on all four.
placeable_all() {
  local port
  for port in "${router_ports[@]}"; do
    [ "$(curl -fsS --max-time 1 "http://127.0.0.1:$port/metrics" | grep -c '^narwhal_engine_available{engine="[pd][12]"} 1')" -eq 4 ] || return 1
  done
}
wait_for "the four simulators' checks" placeable_all

r1=http://127.0.0.1:${router_ports[0]}
r2=http://127.0.0.1:${router_ports[1]}
body='{"model":"'$model'","messages":[{"role":"user","content":"Hello, narwhal!"}],"stream":true,"max_tokens":16}'
cat <<BANNER

Narwhal mesh is up: bus $nats, a breaker, routers r1 $r1 and r2 $r2,
simulators p1 p2 (prefill) and d1 d2 (decode) serving model $model,
each registered in the live fleet by itself.

A streamed chat completion through each router (the response headers
X-Narwhal-Prefill-Engine and X-Narwhal-Decode-Engine name the two engines):

curl -N -i $r1/v1/chat/completions -H 'Content-Type: application/json' -d '$body'
curl -N -i $r2/v1/chat/completions -H 'Content-Type: application/json' -d '$body'

Watch every event of the mesh from another terminal (the viewer credential):

NARWHAL_NATS_URL=$nats NARWHAL_NATS_CREDS=$creds/viewer.creds $bin events

The live fleet (a viewer's credential suffices; drain, undrain, add and
remove take $creds/admin.creds):

NARWHAL_NATS_URL=$nats NARWHAL_NATS_CREDS=$creds/viewer.creds $bin fleet list

Readiness: $r1/readyz   Metrics: $r1/metrics   Logs: $dir/*.log
Press Ctrl-C to stop everything.
BANNER

# Wait until Ctrl-C (the trap stops everything) or until a process exits
# on its own, which stops the rest (stop then shows how each ended).
set +e
wait -n "${pids[@]}"
if [ -z "$stopping" ]; then
  echo "mesh: a process exited on its own" >&2
  exit 1
fi
