// Command gvisor_sentry is gVisor's sentry alone: runsc's `boot` (and the `umount`
// helper boot runs), as the sidecar runsc looks for in gvisor-bin/ beside itself.
// Upstream's Bazel build ships this binary (runsc/cmd/sentry); gVisor's Go branch
// has its packages but not its main, so hack/gvisor/build builds it from here.
// Without it runsc boots each sandbox with its whole self, and cannot run the
// prewarmer (prewarmer/), which needs a boot binary it can exec by path.
package main

import (
	"gvisor.dev/gvisor/runsc/cli"
	"gvisor.dev/gvisor/runsc/cmd/sentry/sentrycmd"
	"gvisor.dev/gvisor/runsc/cmd/util"
	"gvisor.dev/gvisor/runsc/gvisorbinaries"
)

func main() {
	cli.Run(&gvisorbinaries.GvisorSentry, map[util.SubCommand]string{
		new(sentrycmd.Boot):   "internal use only",
		new(sentrycmd.Umount): "internal use only",
	}, nil)
}
