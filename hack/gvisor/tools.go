//go:build tools

// Package tools pins gVisor's runsc and its containerd shim, which
// hack/gvisor/build compiles with `go build gvisor.dev/gvisor/runsc` and
// `go build gvisor.dev/gvisor/shim`. It is its own module so that gVisor's
// dependencies (containerd, grpc, cloud storage, ...) do not move the
// versions any other tool here is built with.
package tools

import (
	_ "gvisor.dev/gvisor/runsc"
	_ "gvisor.dev/gvisor/shim"
)
