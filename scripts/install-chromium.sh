#!/usr/bin/env bash
# Headless Chromium for the browser tests (tests/integration/test_dashboard_browser.py): Debian's
# `chromium` package, driven by Playwright with the system browser (`playwright install` downloads
# its own build, which the machines cannot reach). Idempotent: instant when already installed.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-chromium: chromium is missing; run as root (apt-get install chromium)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# Other jobs on the machine may hold the dpkg lock for a while: wait for it, not fail.
APT=(apt-get -q -o DPkg::Lock::Timeout=600)
"${APT[@]}" update
# fonts-liberation: the page's text renders in the screenshot with metric-compatible fonts.
"${APT[@]}" install -y --no-install-recommends chromium fonts-liberation
chromium --version
