#!/usr/bin/env bash
# A device call carries the working tree (tracked files and untracked ones git does not ignore) and at
# most 64 MiB in all; this checkout holds about 119 MB, 81 of them benchmark results and 26 the
# EAGLE-3 drafter's weights, none of which a GPU check reads. `on`: a throw-away branch device-slim
# where they are untracked and ignored (the files stay where they are), and prints what would travel;
# `off`: back to the branch you came from, which tracks them again.
#   bash benchmarks/device/slim.sh on; ...the device calls...; bash benchmarks/device/slim.sh off
set -euo pipefail
cd "$(dirname "$0")/../.."
BIG=(benchmarks/results drafters/gemma3-270m-eagle3/model.safetensors)
case "${1:-}" in
on)
    git diff --quiet && git diff --cached --quiet || { echo "slim.sh: commit or stash your changes first" >&2; exit 1; }
    git rev-parse --abbrev-ref HEAD > .git/device-slim-from
    git checkout -q -B device-slim
    git rm -r -q --cached "${BIG[@]}"
    for p in "${BIG[@]}"; do grep -qx "/$p" .git/info/exclude || echo "/$p" >> .git/info/exclude; done
    git commit -q -m "device-slim: without ${BIG[*]} (a throw-away branch for device calls; never merge)"
    bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 cat 2>/dev/null | wc -c)
    echo "device-slim: $((bytes / 1000000)) MB of working tree travel with each call, before carried paths"
    ;;
off)
    from=$(cat .git/device-slim-from)
    git checkout -q "$from"
    for p in "${BIG[@]}"; do sed -i "\#^/$p\$#d" .git/info/exclude; done
    git branch -q -D device-slim
    rm .git/device-slim-from
    git status --short | head
    echo "back on $from"
    ;;
*)
    echo "usage: slim.sh on|off" >&2; exit 2
    ;;
esac
