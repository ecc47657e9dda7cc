//go:build tools

// Package tools pins kube-router, whose network-policy controller
// hack/kube/build compiles with `go build .../cmd/kube-router` and
// hack/kube/up runs on the real node (firewall only: no routing, no
// service proxy). It is its own module so that kube-router's dependencies
// do not move the versions the Kubernetes components in ../go.mod were
// released with.
package tools

import _ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
