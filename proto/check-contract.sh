#!/usr/bin/env bash
# buf lint, then buf breaking against the contract of the commit named in proto/BASELINE: the main the
# current change started from ("none" when there was no earlier contract to keep compatible with).
set -euo pipefail
cd "$(dirname "$0")"
buf=./node_modules/.bin/buf
"$buf" lint
base=$(tr -d '[:space:]' < BASELINE)
if [ "$base" = none ]; then
    echo "buf breaking: proto/BASELINE is 'none' (no earlier contract on main); nothing to compare"
    exit 0
fi
"$buf" breaking --against "../.git#ref=${base},subdir=proto"
echo "buf breaking: no breaking change against ${base}"
