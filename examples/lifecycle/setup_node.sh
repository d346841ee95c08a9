#!/usr/bin/env bash
# Lifecycle script: runs on every node after it comes up (see examples/cluster.yaml).
# Records facts about the node in $TRAINPOD_SCRATCH_DIR/node-info.txt and checks that
# python3 and torch import. Safe to run again: the facts file is rewritten.
#
# Environment (set by trainpod): TRAINPOD_NODE, TRAINPOD_GROUP, TRAINPOD_ROLE,
# TRAINPOD_SHARED_DIR, TRAINPOD_SCRATCH_DIR, TRAINPOD_CLUSTER.
set -euo pipefail

node="${TRAINPOD_NODE:?TRAINPOD_NODE is not set}"
scratch="${TRAINPOD_SCRATCH_DIR:?TRAINPOD_SCRATCH_DIR is not set}"
prefix="[setup_node ${TRAINPOD_CLUSTER:-?}/${node}]"

echo "${prefix} group=${TRAINPOD_GROUP:-?} role=${TRAINPOD_ROLE:-?}"

echo "${prefix} checking python3"
if ! command -v python3 >/dev/null 2>&1; then
    echo "${prefix} ERROR: python3 not found on PATH" >&2
    exit 1
fi
python_version="$(python3 -c 'import platform; print(platform.python_version())')"
echo "${prefix} python3 ${python_version}"

echo "${prefix} checking that torch imports"
# Only stdout is captured; import warnings and tracebacks go to our stderr as they are.
if ! torch_version="$(python3 -c 'import torch; print(torch.__version__)')"; then
    echo "${prefix} ERROR: cannot import torch (traceback above)" >&2
    exit 1
fi
echo "${prefix} torch ${torch_version}"

mkdir -p "${scratch}"
info="${scratch}/node-info.txt"
echo "${prefix} writing node facts to ${info}"
# df -P gives one portable line per file system; column 4 is the free space in KiB.
free_kib="$(df -Pk "${scratch}" | awk 'NR == 2 { print $4 }')"
cpus="$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc)"
{
    echo "node=${node}"
    echo "group=${TRAINPOD_GROUP:-}"
    echo "role=${TRAINPOD_ROLE:-}"
    echo "hostname=$(hostname)"
    echo "python=${python_version}"
    echo "torch=${torch_version}"
    echo "cpus=${cpus}"
    echo "scratch_free_kib=${free_kib}"
} >"${info}.tmp"
mv "${info}.tmp" "${info}"   # readers never see a half-written file

echo "${prefix} done"
