//go:build tools

// Package tools pins runc, which hack/kube/build compiles for the harness's
// real node: Debian 12's runc 1.1 has no idmapped mounts, so containerd
// reports that its handler cannot run user namespaces and kubelet refuses
// every pod with `hostUsers: false`. It is its own module so that runc's
// dependencies move nothing else here.
package tools

import (
	_ "github.com/opencontainers/runc"
)
