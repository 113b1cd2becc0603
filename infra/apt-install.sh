#!/bin/bash
# Install Debian packages for the infra tests when missing: `infra/apt-install.sh CMD=PKG ...`
# (e.g. shellcheck=shellcheck). Installs only the packages whose command is absent.
# Exit 3: cannot install here (not root, or apt failed) - callers skip with that reason.
set -euo pipefail
APT_TIMEOUT="${APT_TIMEOUT:-180}"
missing=()
for pair in "$@"; do
    cmd="${pair%%=*}"
    pkg="${pair#*=}"
    command -v "$cmd" >/dev/null || missing+=("$pkg")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "missing ${missing[*]} and not root: cannot apt-get install" >&2
    exit 3
fi
export DEBIAN_FRONTEND=noninteractive
if ! timeout "$APT_TIMEOUT" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    # a fresh machine has no package lists yet
    timeout "$APT_TIMEOUT" apt-get update -q >/dev/null 2>&1 || { echo "apt-get update failed" >&2; exit 3; }
    timeout "$APT_TIMEOUT" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
        || { echo "apt-get install ${missing[*]} failed" >&2; exit 3; }
fi
