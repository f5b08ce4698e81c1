#!/usr/bin/env bash
# The agent's sandbox (docs/security.md): bubblewrap and iptables from Debian's packages and the
# unprivileged user whose group every rank runs in (each rank as a uid of its own from the
# agent's pool, which needs no account: worker/agent/uids.py). Run as root (make install
# does); as another user it only says what is missing, and the agent refuses to start until
# it is there.
set -euo pipefail
SANDBOX_USER="${POLYTRAIN_SANDBOX_USER:-polytrain-run}"
# where worker/engine/ranks.py (JEMALLOC_PATHS) looks for jemalloc
has_jemalloc() {
  local path
  for path in /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 \
    /usr/lib64/libjemalloc.so.2 /usr/lib/libjemalloc.so.2; do
    [ -f "$path" ] && return 0
  done
  return 1
}

if [ "$(id -u)" != 0 ]; then
  command -v bwrap >/dev/null || echo "warning: bubblewrap missing; as root: apt-get install -y bubblewrap" >&2
  command -v iptables >/dev/null || echo "warning: iptables missing; as root: apt-get install -y iptables" >&2
  has_jemalloc || echo "warning: jemalloc missing (POLYTRAIN_JEMALLOC=on needs it); as root: apt-get install -y libjemalloc2" >&2
  id -u "$SANDBOX_USER" >/dev/null 2>&1 || echo "warning: no user $SANDBOX_USER; as root: useradd --system --user-group --no-create-home --shell /usr/sbin/nologin $SANDBOX_USER" >&2
  exit 0
fi
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v iptables >/dev/null || missing+=(iptables)
# jemalloc, for sharded groups' workers where an agent sets POLYTRAIN_JEMALLOC=on
# (worker/engine/ranks.py allocator_env)
has_jemalloc || missing+=(libjemalloc2)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get install -y "${missing[@]}" || { apt-get update && apt-get install -y "${missing[@]}"; }
fi
if ! id -u "$SANDBOX_USER" >/dev/null 2>&1; then
  useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin "$SANDBOX_USER"
fi
