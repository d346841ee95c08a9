#!/usr/bin/env bash
# Lifecycle script: runs on every node after it comes up (see examples/cluster.yaml).
# Creates a home directory on the shared file system for each user in users.txt (next to
# this script; one `name,uid` per line, # starts a comment). Idempotent.
#
# On the local backend we do not create OS users: all nodes are processes of the current
# user, so this is the local stand-in for `useradd --uid <uid> --home-dir ... <name>`,
# which a real cluster would run here instead.
#
# Environment (set by trainpod): TRAINPOD_NODE, TRAINPOD_GROUP, TRAINPOD_ROLE,
# TRAINPOD_SHARED_DIR, TRAINPOD_SCRATCH_DIR, TRAINPOD_CLUSTER.
set -euo pipefail

shared="${TRAINPOD_SHARED_DIR:?TRAINPOD_SHARED_DIR is not set}"
prefix="[create_users ${TRAINPOD_CLUSTER:-?}/${TRAINPOD_NODE:-?}]"
users_file="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/users.txt"

if [[ ! -f "${users_file}" ]]; then
    echo "${prefix} ERROR: users file not found: ${users_file}" >&2
    exit 1
fi

count=0
while IFS= read -r line || [[ -n "${line}" ]]; do
    line="${line%%#*}"                    # drop comments
    line="${line//[[:space:]]/}"          # and all whitespace
    [[ -z "${line}" ]] && continue
    IFS=, read -r name uid <<<"${line}"
    if [[ ! "${name}" =~ ^[a-z_][a-z0-9_-]*$ || ! "${uid:-}" =~ ^[0-9]+$ ]]; then
        echo "${prefix} ERROR: bad line in ${users_file}: '${line}' (want name,uid)" >&2
        exit 1
    fi
    home="${shared}/home/${name}"
    if [[ -d "${home}" ]]; then
        echo "${prefix} user ${name} (uid ${uid}): ${home} already exists"
    else
        mkdir -p "${home}"
        echo "${prefix} user ${name} (uid ${uid}): created ${home}"
    fi
    count=$((count + 1))
done <"${users_file}"

echo "${prefix} ${count} user(s) ready"
