package main

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
)

// overlayExec is the host-side helper `sandmand overlay-exec LOWER UPPER WORK
// TARGET -- PROG ARGS...`: it enters a new, private mount namespace, mounts
// the overlay at TARGET there, and execs PROG (the OCI runtime's `create`).
// The container inherits the namespace, so the mount exists only for it and
// vanishes with it: nothing is ever mounted on the host, and nothing can
// leak if the provider dies. Doing this here rather than in a Python
// preexec_fn lets the provider spawn with vfork, without forking itself.
func overlayExec(args []string) error {
	if len(args) < 6 || args[4] != "--" {
		return fmt.Errorf("usage: sandmand overlay-exec LOWER UPPER WORK TARGET -- PROG [ARGS...]")
	}
	lower, upper, work, target := args[0], args[1], args[2], args[3]
	for _, p := range []string{lower, upper, work} {
		if strings.ContainsAny(p, ",:") {
			return fmt.Errorf("overlay path %q must not contain ',' or ':'", p)
		}
	}
	prog, err := exec.LookPath(args[5])
	if err != nil {
		return err
	}
	// unshare and mount apply to this thread; exec then carries its
	// namespace into the new program.
	runtime.LockOSThread()
	if err := syscall.Unshare(syscall.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare(CLONE_NEWNS): %w", err)
	}
	if err := syscall.Mount("none", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	opts := "lowerdir=" + lower + ",upperdir=" + upper + ",workdir=" + work
	if err := syscall.Mount("overlay", target, "overlay", 0, opts); err != nil {
		return fmt.Errorf("mount overlay on %s: %w", target, err)
	}
	return syscall.Exec(prog, args[5:], os.Environ())
}
