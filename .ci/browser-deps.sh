#!/usr/bin/env bash
# Headless Chromium for the dashboard test (tests/dashboard/test_browser.py), from Debian's
# packages. Root only; without it that test is skipped with the reason.
set -euo pipefail
if command -v chromium >/dev/null; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "browser-deps: not root, skipping (the browser test will be skipped)" >&2
  exit 0
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
