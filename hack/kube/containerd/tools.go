//go:build tools

// Package tools pins containerd 2's daemon, its runc shim and ctr, which
// hack/kube/build compiles for the harness's real node. It is its own module
// so that containerd's dependencies (grpc, otel, ...) do not move the
// versions the Kubernetes components in ../go.mod were released with.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
