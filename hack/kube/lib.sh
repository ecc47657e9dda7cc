# Shared settings for hack/kube/up and hack/kube/down (sourced, not run).
#
# Every setting can be overridden from the environment:
#   SANDMAN_KUBE_DIR         state directory           (/var/lib/sandman-kube)
#   SANDMAN_KUBE_PORT        API server port on 127.0.0.1        (6443)
#   SANDMAN_KUBE_ETCD_PORT   etcd client port on 127.0.0.1       (23790)
#   SANDMAN_KUBE_KWOK_NODES  number of simulated (KWOK) nodes    (10)
#   SANDMAN_KUBE_REAL_NODE   start the real node (kubelet+containerd), 1|0 (1)
#   SANDMAN_KUBE_BIN         where hack/kube/build put the binaries (hack/kube/.bin)

KUBE_HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
S=${SANDMAN_KUBE_DIR:-/var/lib/sandman-kube}
BIN=${SANDMAN_KUBE_BIN:-$KUBE_HACK/.bin}
API_PORT=${SANDMAN_KUBE_PORT:-6443}
ETCD_PORT=${SANDMAN_KUBE_ETCD_PORT:-23790}
ETCD_PEER_PORT=$((ETCD_PORT + 10))
KWOK_NODES=${SANDMAN_KUBE_KWOK_NODES:-10}
REAL_NODE=${SANDMAN_KUBE_REAL_NODE:-1}

# The real node's pods live on a bridge of our own; the host side of that
# bridge is also the node's address (kubelet refuses a loopback node IP).
# Traffic to it never leaves this machine.
NODE_NAME=sandman-node
BRIDGE=sandmank8s0
POD_SUBNET=10.213.0.0/24
NODE_IP=10.213.0.1
SERVICE_RANGE=10.213.128.0/24   # allocated only: no kube-proxy, never routed
CGROUP_ROOT=sandman-kube         # kubelet's cgroupRoot, in every hierarchy

ADMIN_KUBECONFIG=$S/admin.kubeconfig
USER_KUBECONFIG=$S/sandman.kubeconfig
CTR_SOCK=$S/containerd/containerd.sock

log() { echo "kube: $*" >&2; }
die() { log "error: $*"; exit 1; }

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }
ctr_k8s() { ctr --address "$CTR_SOCK" --namespace k8s.io "$@"; }

# pid_alive NAME: the process recorded for NAME still runs the binary we started.
pid_alive() {
    local pidf=$S/run/$1.pid pid
    [[ -f $pidf ]] || return 1
    pid=$(<"$pidf")
    [[ -n $pid && -d /proc/$pid ]] || return 1
    grep -qF -- "$(<"$S/run/$1.exe")" "/proc/$pid/cmdline" 2>/dev/null
}

# cgroup_dirs: our cgroup root in every v1 hierarchy (and the unified one).
cgroup_dirs() {
    local d
    for d in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
        [[ -d $d$CGROUP_ROOT ]] && echo "$d$CGROUP_ROOT"
    done
    return 0
}
