#!/usr/bin/env bash
# Install Debian's nginx (nginx-light: it has the upstream hash and map modules the partitions'
# global tier needs), for tests/integration/test_nginx_partitions.py and `evinfra partitions
# nginx`. The tests run nginx as their own child process with a temporary prefix, never the
# system service, so the package's service is kept from starting at install.
#
#   scripts/install-nginx.sh
#
# Idempotent: when an nginx binary is already there it only prints its version (milliseconds).
# Needs root (apt-get) the first time; about 10 seconds and 2 MB.
set -euo pipefail

if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-nginx.sh: nginx is missing and installing it needs root (apt-get install nginx-light)" >&2
  exit 1
fi

# Debian starts a package's service at install unless policy-rc.d says no: the system nginx would
# take port 80 and run as a daemon, which nothing here wants.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$POLICY"
  chmod +x "$POLICY"
  trap 'rm -f "$POLICY"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
/usr/sbin/nginx -v
