//go:build tools

// Package tools pins KWOK's controller command, which hack/kube/build
// compiles with `go build sigs.k8s.io/kwok/cmd/kwok`. It is its own module
// so that KWOK's newer dependencies (otel, grpc) do not move the versions
// the Kubernetes components in ../go.mod were released with.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
