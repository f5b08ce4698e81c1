#!/usr/bin/env bash
# Make sure this machine's PostgreSQL and Redis answer on 127.0.0.1 (the production stack the
# tests use when POLYTRAIN_TEST_DATABASE_URL / POLYTRAIN_TEST_BROKER_URL are set). A stopped
# server is started with the machine's own command; exits 1 if one still does not answer.
set -uo pipefail

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432; }
redis_up() { [ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = "PONG" ]; }

wait_for() {  # wait_for CHECK SECONDS
  local i
  for ((i = 0; i < $2 * 5; i++)); do "$1" && return 0; sleep 0.2; done
  return 1
}

if ! pg_up; then
  echo "PostgreSQL is not answering on 127.0.0.1:5432: starting it" >&2
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  wait_for pg_up 30 || { echo "PostgreSQL cannot be reached" >&2; exit 1; }
fi
if ! redis_up; then
  echo "Redis is not answering on 127.0.0.1:6379: starting it" >&2
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  wait_for redis_up 30 || { echo "Redis cannot be reached" >&2; exit 1; }
fi
echo "PostgreSQL and Redis answer on 127.0.0.1" >&2
