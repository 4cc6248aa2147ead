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
if ! git cat-file -e "${base}^{commit}" 2>/dev/null; then
    timeout 60 git fetch --quiet origin "$base" 2>/dev/null || true
fi
if ! git cat-file -e "${base}^{commit}" 2>/dev/null; then
    echo "buf breaking: the baseline commit ${base} (proto/BASELINE) is not in this clone;" \
        "clone the full history (git fetch --unshallow) to compare the contract with it" >&2
    exit 1
fi
"$buf" breaking --against "$(git rev-parse --show-toplevel)/.git#ref=${base},subdir=proto"
echo "buf breaking: no breaking change against ${base}"
