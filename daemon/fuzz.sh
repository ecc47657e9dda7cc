#!/bin/sh
# Runs every fuzz target for ${FUZZTIME:-10s}; Go fuzzes one target per
# `go test` invocation, hence the loop.
#
# On a loaded machine Go's fuzzer sometimes fails with only "context deadline
# exceeded" when the time is up and a worker is slow to stop (golang/go#48127
# and friends). That is not a finding: a real one always writes its input
# ("Failing input written to testdata/fuzz/..."), so only that, or any other
# failure, fails the run.
#
# Each input that finds new coverage is minimized before fuzzing goes on, by
# default for up to 60 s; its removal of every subset of bytes is ~n² runs,
# counted only once it ends. One such input could hold a worker for a whole
# short run while the log showed "0/sec". ${FUZZMINIMIZETIME:-1s} bounds it
# (a failing input is still written, just less shrunk: rerun it with a
# longer -fuzzminimizetime to shrink it further).
set -eu
cd "$(dirname "$0")"
t=${FUZZTIME:-10s}
m=${FUZZMINIMIZETIME:-1s}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for pkg in ./internal/server ./internal/archive; do
	for target in $(go test -list '^Fuzz' "$pkg" | grep '^Fuzz'); do
		echo "== $pkg $target ($t)"
		if go test -run='^$' -fuzz="^${target}\$" -fuzztime="$t" -fuzzminimizetime="$m" "$pkg" >"$log" 2>&1; then
			cat "$log"
		elif grep -q 'context deadline exceeded' "$log" && ! grep -q 'Failing input written' "$log"; then
			cat "$log"
			echo "   (the fuzzer overran its time while stopping; no failing input: not a finding)"
		else
			cat "$log"
			exit 1
		fi
	done
done
