#!/usr/bin/env bash
# Tools for the network-namespace tests (tests/netsim, marker "netns") and benchmarks/wan.py:
# iproute2 (ip, tc) and nftables (the NAT'd hosts' masquerading router). Root only; without
# them the netns tests are skipped with the reason.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "netns-deps: not root, skipping (the netns tests will be skipped)" >&2
  exit 0
fi
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v tc >/dev/null || missing+=(iproute2)
command -v nft >/dev/null || missing+=(nftables)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
