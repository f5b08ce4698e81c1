#!/usr/bin/env bash
# `make test`'s own set-up on a fresh machine, before pytest starts:
#  - Debian's Chromium for the browser tests (never a downloaded build) and redis-server for
#    the compose test: installed with apt-get when missing and we are root, else the run stops
#    at once with the one command to run;
#  - when the production stack is configured (POLYTRAIN_TEST_DATABASE_URL /
#    POLYTRAIN_TEST_BROKER_URL) on this machine, PostgreSQL and Redis are started if stopped
#    (scripts/local_services.sh, as .ci/run does).
# POLYTRAIN_CHROMIUM overrides the browser's path; POLYTRAIN_NO_INSTALL=1 never installs.
set -euo pipefail
cd "$(dirname "$0")/.."

chromium="${POLYTRAIN_CHROMIUM:-/usr/bin/chromium}"
missing=()
[ -x "$chromium" ] || missing+=(chromium)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)

if [ ${#missing[@]} -gt 0 ]; then
  command_line="apt-get update && apt-get install -y ${missing[*]}"
  if [ "${POLYTRAIN_NO_INSTALL:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null
  then
    echo "make test: ${missing[*]} missing; installing: $command_line" >&2
    apt-get -o DPkg::Lock::Timeout=300 update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
         "${missing[@]}" >/dev/null \
      || { echo "make test: installing ${missing[*]} failed; run: $command_line" >&2; exit 1; }
    [ -x "$chromium" ] || { echo "make test: $chromium still missing after installing" >&2; exit 1; }
  else
    [ "$(id -u)" = 0 ] || command_line="sudo sh -c '$command_line'"
    echo "make test: ${missing[*]} missing (the browser and compose tests need them); run:" >&2
    echo "    $command_line" >&2
    exit 1
  fi
fi

local_url() { [[ "${1:-}" =~ @?(127\.0\.0\.1|localhost)(:[0-9]+)?(/|$) ]]; }
if [ -n "${POLYTRAIN_TEST_DATABASE_URL:-}${POLYTRAIN_TEST_BROKER_URL:-}" ]; then
  if local_url "${POLYTRAIN_TEST_DATABASE_URL:-}" || local_url "${POLYTRAIN_TEST_BROKER_URL:-}"
  then
    scripts/local_services.sh || {
      echo "make test: the production stack is configured but PostgreSQL/Redis cannot be" \
           "started here; run scripts/local_services.sh, or unset POLYTRAIN_TEST_DATABASE_URL" \
           "and POLYTRAIN_TEST_BROKER_URL to test on the embedded default" >&2
      exit 1
    }
  fi
fi
