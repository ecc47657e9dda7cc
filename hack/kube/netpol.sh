# NetworkPolicy enforcement on the real node, for hack/kube/up and
# hack/kube/down (sourced after lib.sh, not run).
#
# The CNI bridge plugin ignores NetworkPolicies. kube-router's network-policy
# controller (built by hack/kube/build from netpol/go.mod) enforces them with
# iptables and ipsets in the host's filter table; it runs with the firewall
# only: no routing (whose GoBGP API has had advisories), no service proxy.
#
# Why not sigs.k8s.io/kube-network-policies: its datapath hands new
# connections to user space with nftables' `queue` statement, and this
# machine's kernel is built without CONFIG_NFT_QUEUE ("Could not process
# rule: No such file or directory"); kube-router needs only iptables'
# filter table, ipset and br_netfilter.
#
# kube-router's chains (KUBE-ROUTER-*, KUBE-NWPLCY-*, KUBE-POD-FW-*) and
# ipsets (KUBE-SRC-*, KUBE-DST-*) are host-wide names: only one harness per
# machine may enforce policies (a second one sets SANDMAN_KUBE_NETPOL=0).

NETPOL=${SANDMAN_KUBE_NETPOL:-1}
NETPOL_USER=sandman-kube-netpol
NETPOL_CHAINS='^KUBE-(ROUTER|NWPLCY|POD-FW)-'
NETPOL_SETS='^(inet6:)?(KUBE-(SRC|DST)-|TMP-)'
BRIDGE_NF=/proc/sys/net/bridge/bridge-nf-call-iptables

# netpol_check: what the agent needs is on this machine.
netpol_check() {
    command -v iptables > /dev/null || die "iptables missing: apt-get install iptables"
    command -v ipset > /dev/null || die "ipset missing: apt-get install ipset (scripts/setup does)"
    [[ -x $BIN/kube-router ]] || die "$BIN/kube-router missing: run hack/kube/build"
    # Bridged pod-to-pod traffic reaches iptables only through br_netfilter.
    [[ -e $BRIDGE_NF ]] || die "$BRIDGE_NF missing: the kernel needs br_netfilter (modprobe br_netfilter)"
}

# netpol_record: what exists before kube-router, so that down removes only what appeared.
netpol_record() {
    cat "$BRIDGE_NF" > "$S/run/bridge-nf-call-iptables.before"
    nft list tables 2>/dev/null > "$S/run/before.nft" || true
    ipset list -n 2>/dev/null > "$S/run/before.ipset" || true
}

# netpol_start: kube-router for the real node, with its own identity (a client
# certificate) and a read-only ClusterRole. Needs the Node object registered.
netpol_start() {
    touch "$S/run/netpol.started"   # from here on, down has something to undo
    echo 1 > "$BRIDGE_NF"
    cert netpol "/O=$NETPOL_USER/CN=$NETPOL_USER"
    cat > "$S/netpol.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: sandman-kube
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $pki/ca.crt
users:
- name: $NETPOL_USER
  user:
    client-certificate: $pki/netpol.crt
    client-key: $pki/netpol.key
contexts:
- name: $NETPOL_USER@sandman-kube
  context: {cluster: sandman-kube, user: $NETPOL_USER}
current-context: $NETPOL_USER@sandman-kube
EOF
    chmod 600 "$S/netpol.kubeconfig" "$pki/netpol.key"
    # Its informers list and watch all of these, even those only the
    # (disabled) router and proxy use; it writes nothing.
    kubectl_admin apply -f - > /dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: $NETPOL_USER}
rules:
- apiGroups: [""]
  resources: [pods, namespaces, nodes, services, endpoints]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: $NETPOL_USER}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: $NETPOL_USER}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: $NETPOL_USER}
EOF
    # IPv4 only, as the pod network is. Health and metrics servers off (they
    # would listen on every address). The service range only lets pods reach
    # service IPs, which nothing routes here. Niced (it inherits the
    # subshell's priority, every thread): it re-syncs all its rules on every
    # pod change in the cluster, KWOK's too, about 26 s of CPU over a
    # 1,000-sandbox burst, which should not be taken from what is measured.
    (
        renice -n 10 -p "$BASHPID" > /dev/null
        start netpol "$BIN/kube-router" --kubeconfig "$S/netpol.kubeconfig" \
            --hostname-override "$NODE_NAME" \
            --run-firewall=true --run-router=false --run-service-proxy=false --enable-cni=false \
            --enable-ipv4=true --enable-ipv6=false --service-cluster-ip-range "$SERVICE_RANGE" \
            --health-port 0 --metrics-port 0 --v=1
    )
}

# netpol_ready: its top-level chains are in place (it has synced once).
netpol_ready() {
    pid_alive netpol && iptables -w -t filter -S KUBE-ROUTER-FORWARD > /dev/null 2>&1
}

# netpol_cleanup: after kube-router stopped, remove the jumps to its chains,
# its chains and ipsets, the iptables-nft tables that appeared for them, and
# put bridge-nf-call-iptables back. Only what appeared since up recorded.
netpol_cleanup() {
    [[ -f $S/run/netpol.started ]] || return 0
    local chain n chains set family table
    if command -v iptables > /dev/null && iptables -w -t filter -S > /dev/null 2>&1; then
        # Rules that jump to its chains, from any chain, by number, last first.
        for chain in $(iptables -w -t filter -S | awk '$1 == "-P" || $1 == "-N" {print $2}'); do
            iptables -w -t filter -L "$chain" -n --line-numbers 2>/dev/null |
                awk -v re="$NETPOL_CHAINS" 'NR > 2 && $2 ~ re {print $1}' | sort -rn |
                while read -r n; do iptables -w -t filter -D "$chain" "$n"; done
        done
        chains=$(iptables -w -t filter -S | awk -v re="$NETPOL_CHAINS" '$1 == "-N" && $2 ~ re {print $2}')
        for chain in $chains; do iptables -w -t filter -F "$chain"; done
        for chain in $chains; do
            log "removing iptables chain $chain (kube-router)"
            iptables -w -t filter -X "$chain"
        done
    fi
    if command -v ipset > /dev/null; then
        for set in $(ipset list -n 2>/dev/null | grep -E "$NETPOL_SETS"); do
            grep -qxF -- "$set" "$S/run/before.ipset" 2>/dev/null && continue
            ipset destroy "$set" 2>/dev/null || log "warning: ipset $set not removed"
        done
    fi
    # iptables-nft made its tables (ip filter) if they did not exist: remove
    # them if they appeared and hold no rule now.
    nft list tables 2>/dev/null | while read -r _ family table; do
        [[ $family == ip || $family == ip6 ]] || continue
        case $table in filter | nat | mangle | raw | security) ;; *) continue ;; esac
        grep -qxF -- "table $family $table" "$S/run/before.nft" 2>/dev/null && continue
        if nft list table "$family" "$table" 2>/dev/null | grep -qvE '^\s*(table |chain |type |}|$)'; then
            log "warning: nftables table $family $table appeared and is not empty: left"
        else
            log "removing nftables table $family $table (made by iptables-nft for kube-router)"
            nft delete table "$family" "$table"
        fi
    done
    if [[ -s $S/run/bridge-nf-call-iptables.before && -e $BRIDGE_NF ]]; then
        cat "$S/run/bridge-nf-call-iptables.before" > "$BRIDGE_NF"
    fi
    rm -f "$S/run/netpol.started"
}
