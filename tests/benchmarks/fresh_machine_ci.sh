#!/usr/bin/env bash
# A fresh machine's `.ci/run`, measured: a new clone of this repository and every cache empty
# (phalanx's, Go's build and module caches, pip's) but torch's wheels, which are fetched once and
# never again (hard-linked from the phalanx wheel cache). Each output line is stamped with the
# seconds since the start; free disk is logged each minute (the run writes about 37 GB).
#   bash tests/benchmarks/fresh_machine_ci.sh [SCRATCH_DIR] > fresh.log 2>&1
set -u
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
scratch=${1:-/tmp/fresh}
wheels=${PHALANX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/phalanx}/wheels
rm -rf "$scratch"
mkdir -p "$scratch/cache/wheels" "$scratch/gocache" "$scratch/gomod" "$scratch/pip"
cp -al "$wheels"/torch-* "$wheels"/nvidia_* "$wheels"/triton-* "$scratch/cache/wheels/"
git clone -q "$repo" "$scratch/repo"
cd "$scratch/repo" && git log --oneline -1
start=$(date +%s)
( while sleep 60; do echo "DF $(( $(date +%s) - start )) $(df --output=avail,pcent / | tail -1)"; done ) &
watcher=$!
PHALANX_CACHE_DIR=$scratch/cache GOCACHE=$scratch/gocache GOMODCACHE=$scratch/gomod PIP_CACHE_DIR=$scratch/pip \
  CI=true PYTEST_ADDOPTS=-v bash .ci/run 2>&1 | while IFS= read -r line; do echo "$(( $(date +%s) - start )) $line"; done
echo "EXIT ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
kill "$watcher"
