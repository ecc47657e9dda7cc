//go:build tools

// Package tools pins the Kubernetes commands that hack/kube/build compiles
// with `go build k8s.io/kubernetes/cmd/<name>`; nothing here is run.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
