#!/usr/bin/env bash
# Run a command in a loopback-only network namespace when this machine allows it.
#
# Ray 2.60 binds some worker gRPC ports on every interface even when told to use 127.0.0.1;
# inside a fresh network namespace the only interface is `lo`, so nothing the tests start
# can be reached from, or talk to, another machine. Needs unprivileged user namespaces or
# root; elsewhere the command runs as is (say so, and set GRPOFLOW_REQUIRE_LOOPBACK=1 to
# fail instead).
set -euo pipefail
if [[ "${GRPOFLOW_NO_NETNS:-0}" != 1 ]] && unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && exec "$@"' loopback "$@"
elif [[ "${GRPOFLOW_NO_NETNS:-0}" != 1 ]] && unshare -rn true 2>/dev/null; then
  exec unshare -rn bash -c 'ip link set lo up && exec "$@"' loopback "$@"
fi
if [[ "${GRPOFLOW_REQUIRE_LOOPBACK:-0}" == 1 ]]; then
  echo "loopback.sh: cannot create a network namespace here (unshare -n failed)" >&2
  exit 1
fi
echo "loopback.sh: no network namespace available; running with the host network" >&2
exec "$@"
