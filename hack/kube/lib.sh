# Shared settings for hack/kube/up and hack/kube/down (sourced, not run).
#
# Every setting can be overridden from the environment:
#   SANDMAN_KUBE_DIR         state directory           (/var/lib/sandman-kube)
#   SANDMAN_KUBE_PORT        API server port on 127.0.0.1        (6443)
#   SANDMAN_KUBE_ETCD_PORT   etcd client port on 127.0.0.1       (23790; peer port +10)
#   SANDMAN_KUBE_KWOK_NODES  number of simulated (KWOK) nodes    (10)
#   SANDMAN_KUBE_REAL_NODE   start the real node (kubelet+containerd), 1|0 (1)
#   SANDMAN_KUBE_BIN         where hack/kube/build put the binaries (hack/kube/.bin)
#   SANDMAN_KUBE_NODE_GRACE  how long a node may miss heartbeats before the
#                            controller-manager calls it NotReady and marks its
#                            pods not Ready (unset: Kubernetes' default, 50s). Benchmarks
#                            that saturate the API server raise it (10m): KWOK's
#                            heartbeats lapse then, and KWOK never makes a pod
#                            Ready again, so a heartbeat late under load would
#                            strand pods for good.
#   SANDMAN_KUBE_CONTAINERD  the real node's runtime: "built" (containerd 2, from
#                            hack/kube/build) or "debian" (Debian's containerd 1.6
#                            package, if installed: only to compare)      (built)
#   SANDMAN_KUBE_RUNC        the real node's runc: "built" (runc 1.5 from
#                            hack/kube/build: idmapped mounts, so pods may have
#                            `hostUsers: false`; Debian's if it was not built) or
#                            "debian" (Debian's runc 1.1: no user namespaces) (built)
#   SANDMAN_KUBE_GVISOR      1: containerd gets the runtime handler "runsc" (gVisor
#                            from hack/gvisor/build, via its shim) and the cluster
#                            the RuntimeClass "gvisor"; 0: neither. Needs the
#                            built containerd                                    (1)
# and, to run a second cluster beside the first on one machine, everything
# else the two would share (give each cluster its own value of every one):
#   SANDMAN_KUBE_NET         first two octets of the cluster's addresses (10.213):
#                            pods $NET.0.0/24 on the bridge, node $NET.0.1,
#                            services $NET.128.0/24, KWOK pods $NET.64.0/18
#   SANDMAN_KUBE_BRIDGE      the real node's bridge                (sandmank8s0)
#   SANDMAN_KUBE_CGROUP_ROOT kubelet's cgroupRoot, in every hierarchy (sandman-kube)
#   SANDMAN_KUBE_KCM_PORT, SANDMAN_KUBE_SCHEDULER_PORT   secure ports on 127.0.0.1
#                            of the controller-manager and scheduler (10257, 10259)
#   SANDMAN_KUBE_KUBELET_PORT, SANDMAN_KUBE_KUBELET_HEALTHZ_PORT   (10250, 10248)
#   SANDMAN_KUBE_KWOK_PORT   KWOK's metrics/debug server on 127.0.0.1  (10249)
# e.g. SANDMAN_KUBE_DIR=/var/lib/sandman-kube-b SANDMAN_KUBE_NET=10.214
#   SANDMAN_KUBE_BRIDGE=sandmank8s1 SANDMAN_KUBE_CGROUP_ROOT=sandman-kube-b
#   SANDMAN_KUBE_PORT=7443 SANDMAN_KUBE_ETCD_PORT=24790 SANDMAN_KUBE_KCM_PORT=11257
#   SANDMAN_KUBE_SCHEDULER_PORT=11259 SANDMAN_KUBE_KUBELET_PORT=11250
#   SANDMAN_KUBE_KUBELET_HEALTHZ_PORT=11248 SANDMAN_KUBE_KWOK_PORT=11249 hack/kube/up
# (and the same variables for hack/kube/down).

KUBE_HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
S=${SANDMAN_KUBE_DIR:-/var/lib/sandman-kube}
BIN=${SANDMAN_KUBE_BIN:-$KUBE_HACK/.bin}
API_PORT=${SANDMAN_KUBE_PORT:-6443}
ETCD_PORT=${SANDMAN_KUBE_ETCD_PORT:-23790}
ETCD_PEER_PORT=$((ETCD_PORT + 10))
KCM_PORT=${SANDMAN_KUBE_KCM_PORT:-10257}
SCHEDULER_PORT=${SANDMAN_KUBE_SCHEDULER_PORT:-10259}
KUBELET_PORT=${SANDMAN_KUBE_KUBELET_PORT:-10250}
KUBELET_HEALTHZ_PORT=${SANDMAN_KUBE_KUBELET_HEALTHZ_PORT:-10248}
KWOK_PORT=${SANDMAN_KUBE_KWOK_PORT:-10249}
KWOK_NODES=${SANDMAN_KUBE_KWOK_NODES:-10}
REAL_NODE=${SANDMAN_KUBE_REAL_NODE:-1}
NODE_GRACE=${SANDMAN_KUBE_NODE_GRACE:-}
[[ -z $NODE_GRACE || $NODE_GRACE =~ ^[0-9]+(s|m|h)$ ]] || { echo "kube: SANDMAN_KUBE_NODE_GRACE must be a duration like 40s or 10m, not '$NODE_GRACE'" >&2; exit 1; }
CONTAINERD=${SANDMAN_KUBE_CONTAINERD:-built}
case $CONTAINERD in
built) CONTAINERD_BIN=$BIN/containerd CTR=$BIN/ctr ;;
debian) CONTAINERD_BIN=/usr/bin/containerd CTR=/usr/bin/ctr ;;
*) echo "kube: SANDMAN_KUBE_CONTAINERD must be built or debian, not '$CONTAINERD'" >&2; exit 1 ;;
esac
RUNC=${SANDMAN_KUBE_RUNC:-built}
case $RUNC in
built) RUNC_BIN=$BIN/runc; [[ -x $RUNC_BIN ]] || RUNC_BIN=/usr/sbin/runc ;;
debian) RUNC_BIN=/usr/sbin/runc ;;
*) echo "kube: SANDMAN_KUBE_RUNC must be built or debian, not '$RUNC'" >&2; exit 1 ;;
esac
GVISOR_BIN=${KUBE_HACK%/*}/gvisor/.bin   # hack/gvisor/build put runsc and its shim here
GVISOR=${SANDMAN_KUBE_GVISOR:-1}
[[ $GVISOR == [01] ]] || { echo "kube: SANDMAN_KUBE_GVISOR must be 1 or 0, not '$GVISOR'" >&2; exit 1; }
[[ $CONTAINERD == built ]] || GVISOR=0   # containerd 1.6's config here names no shim by path

# The real node's pods live on a bridge of our own; the host side of that
# bridge is also the node's address (kubelet refuses a loopback node IP).
# Traffic to it never leaves this machine.
NODE_NAME=sandman-node
NET=${SANDMAN_KUBE_NET:-10.213}
[[ $NET =~ ^[0-9]{1,3}\.[0-9]{1,3}$ ]] || { echo "kube: SANDMAN_KUBE_NET must be two octets (like 10.213), not '$NET'" >&2; exit 1; }
BRIDGE=${SANDMAN_KUBE_BRIDGE:-sandmank8s0}
POD_SUBNET=$NET.0.0/24
NODE_IP=$NET.0.1
POD_RANGE_START=$NET.0.10         # below: the node, KWOK's node address
KWOK_NODE_IP=$NET.0.2
KWOK_POD_CIDR=$NET.64.0/18
SERVICE_RANGE=$NET.128.0/24       # allocated only: no kube-proxy, never routed
CGROUP_ROOT=${SANDMAN_KUBE_CGROUP_ROOT:-sandman-kube}   # kubelet's cgroupRoot, in every hierarchy

ADMIN_KUBECONFIG=$S/admin.kubeconfig
USER_KUBECONFIG=$S/sandman.kubeconfig
CTR_SOCK=$S/containerd/containerd.sock

log() { echo "kube: $*" >&2; }
die() { log "error: $*"; exit 1; }

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }
# The ctr of the containerd up started (it records which), else the configured
# one's, else any (a cluster from an up of before the record: Debian's 1.6).
ctr_k8s() {
    local ctr
    ctr=$(cat "$S/run/ctr" 2>/dev/null || echo "$CTR")
    [[ -x $ctr ]] || ctr=ctr
    "$ctr" --address "$CTR_SOCK" --namespace k8s.io "$@"
}

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
