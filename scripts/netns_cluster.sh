#!/usr/bin/env bash
# polytrain across hosts on one machine: the API, the broker and three agents each in a network
# namespace of its own, joined by veth pairs to a bridge (10.77.0.0/24, addresses of this
# project's own, inside namespaces this script creates and deletes). Group cpu-a spans two
# hosts (agents a1 on 10.77.0.3 and a2 on 10.77.0.5, one worker each), group cpu-b one (agent b
# on 10.77.0.4). A task takes all three workers, so its Celery traffic (agents <-> Redis), the
# allreduce inside cpu-a (10.77.0.3 <-> 10.77.0.5) and the parameter-server exchange across
# groups cross namespaces: nothing can assume localhost. netns_check.py then compares the
# task's final checkpoint with a single-process replay of the same seeded batches (1e-5).
#
#   sudo scripts/netns_cluster.sh        # prints one JSON line; exit 0 when the task succeeded
#
# Needs root (ip netns, veth), redis-server, and the project's .venv. Exit 2 if namespaces are
# refused here.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
PREFIX=${PT_NETNS_PREFIX:-ptn$$}
WORK=$(mktemp -d /tmp/polytrain-netns.XXXXXX)
TOKEN=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
ADMIN_PASSWORD=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
declare -A ADDR=([api]=10.77.0.1 [broker]=10.77.0.2 [a1]=10.77.0.3 [b]=10.77.0.4 [a2]=10.77.0.5)
declare -A GROUP=([a1]=cpu-a [a2]=cpu-a [b]=cpu-b)
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 1
  for host in api broker a1 a2 b sw; do
    ip netns pids "$PREFIX-$host" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$PREFIX-$host" 2>/dev/null || true
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

if ! ip netns add "$PREFIX-sw" 2>/dev/null; then
  echo "network namespaces are refused on this machine (ip netns add failed)" >&2
  exit 2
fi
ip netns exec "$PREFIX-sw" ip link add br0 type bridge
ip netns exec "$PREFIX-sw" ip link set br0 up
for host in api broker a1 a2 b; do
  ns="$PREFIX-$host"
  ip netns add "$ns"
  ip link add "$PREFIX$host" type veth peer name "$PREFIX${host}p"
  ip link set "$PREFIX$host" netns "$ns"
  ip link set "$PREFIX${host}p" netns "$PREFIX-sw"
  ip netns exec "$ns" ip link set "$PREFIX$host" name eth0
  ip netns exec "$ns" ip addr add "${ADDR[$host]}/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
  ip netns exec "$ns" ip link set lo up
  ip netns exec "$PREFIX-sw" ip link set "$PREFIX${host}p" master br0 up
done

run_in() {  # run_in HOST LOG ENV... -- COMMAND...: start COMMAND in HOST's namespace
  local host=$1 log=$2; shift 2
  local env=()
  while [ "$1" != "--" ]; do env+=("$1"); shift; done
  shift
  ip netns exec "$PREFIX-$host" env "${env[@]}" "$@" >"$WORK/$log.log" 2>&1 &
  PIDS+=($!)
  disown $!
}

COMMON=(PYTHONPATH="$ROOT" POLYTRAIN_AGENT_TOKEN="$TOKEN" BROKER_URL="redis://${ADDR[broker]}:6379/0"
        PYTHONUNBUFFERED=1)
run_in broker redis -- redis-server --bind "${ADDR[broker]}" --port 6379 --save "" \
  --appendonly no --protected-mode no --dir "$WORK"
# A listener on the broker's host in the ephemeral port range: no rank may reach it (the
# ranks' network filter lets them reach only their task's hosts); netns_check.py probes it.
run_in broker probe "${COMMON[@]}" -- "$PY" -c "
import socket
server = socket.create_server(('${ADDR[broker]}', 45000))
while True:
    server.accept()[0].close()"
API_ENV=("${COMMON[@]}" POLYTRAIN_DATA_DIR="$WORK/api" POLYTRAIN_ADMIN_EMAIL=admin@netns.test
         POLYTRAIN_ADMIN_PASSWORD="$ADMIN_PASSWORD")
mkdir -p "$WORK/api" "$WORK/a1" "$WORK/a2" "$WORK/b"
ip netns exec "$PREFIX-api" env "${API_ENV[@]}" "$PY" -m polytrain.cli db upgrade
run_in api api "${API_ENV[@]}" -- "$PY" -m polytrain.cli api --host "${ADDR[api]}" --port 8000
CHECK=(env PYTHONPATH="$ROOT" "$PY" "$ROOT/scripts/netns_check.py" "http://${ADDR[api]}:8000"
       admin@netns.test "$ADMIN_PASSWORD" "${ADDR[a1]}" "${ADDR[a2]}" "${ADDR[b]}")
ip netns exec "$PREFIX-api" "${CHECK[@]}" groups  # an admin creates the groups first
for host in a1 a2 b; do
  run_in "$host" "agent-$host" "${COMMON[@]}" POLYTRAIN_DATA_DIR="$WORK/$host" \
    POLYTRAIN_API_URL="http://${ADDR[api]}:8000" POLYTRAIN_ADVERTISE_ADDR="${ADDR[$host]}" \
    GLOO_SOCKET_IFNAME=eth0 -- \
    "$PY" -m polytrain.cli agent --resource-group "${GROUP[$host]}" --workers 1 \
    --name "agent-$host"
done
# The client runs on the API's host.
if ip netns exec "$PREFIX-api" "${CHECK[@]}" task; then
  exit 0
fi
echo "--- logs" >&2
tail -n 30 "$WORK"/*.log >&2
exit 1
