#!/bin/sh
# Runs every fuzz target for ${FUZZTIME:-10s}; Go fuzzes one target per
# `go test` invocation, hence the loop.
set -eu
cd "$(dirname "$0")"
t=${FUZZTIME:-10s}
for pkg in ./internal/server ./internal/archive; do
	for target in $(go test -list '^Fuzz' "$pkg" | grep '^Fuzz'); do
		echo "== $pkg $target ($t)"
		go test -run='^$' -fuzz="^${target}\$" -fuzztime="$t" "$pkg"
	done
done
