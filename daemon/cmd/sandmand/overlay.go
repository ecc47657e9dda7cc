package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
)

// hideSysNetFlag hides the host's /proc/sys/net from the program run (see
// hideSysNet).
const hideSysNetFlag = "--hide-sys-net"

// sysfsFlag is `--sysfs=NETNS`: mount TARGET/sys for the network namespace at NETNS
// (`mountSysfs`): the sandbox's own, or one empty namespace every sandbox shares.
const sysfsFlag = "--sysfs="

// overlayExec is the host-side helper `sandmand overlay-exec [--hide-sys-net]
// [--userns=BASE:SIZE:PATH] [--sysfs=NETNS] LOWER[:LOWER...] UPPER WORK TARGET -- PROG
// ARGS...`: it enters a new, private mount namespace, makes the sandbox's user
// namespace there if asked (`newUserns`), mounts the overlay at TARGET (`mountLayers`:
// its layers idmapped into that user namespace), and execs PROG (the OCI runtime's
// `create`). The container inherits the namespace, so the mount
// exists only for it and vanishes with it: nothing is ever mounted on the
// host, and nothing can leak if the provider dies. Doing this here rather
// than in a Python preexec_fn lets the provider spawn with vfork, without
// forking itself.
func overlayExec(args []string) error {
	hide := len(args) > 0 && args[0] == hideSysNetFlag
	if hide {
		args = args[1:]
	}
	var ids *idRange
	if len(args) > 0 && strings.HasPrefix(args[0], usernsFlag) {
		r, err := parseUserns(strings.TrimPrefix(args[0], usernsFlag))
		if err != nil {
			return err
		}
		ids, args = &r, args[1:]
	}
	sysfs := ""
	if len(args) > 0 && strings.HasPrefix(args[0], sysfsFlag) {
		sysfs, args = strings.TrimPrefix(args[0], sysfsFlag), args[1:]
	}
	if len(args) < 6 || args[4] != "--" {
		return fmt.Errorf("usage: sandmand overlay-exec [%s] [%sBASE:SIZE:PATH] [%sNETNS] LOWER UPPER WORK TARGET -- PROG [ARGS...]", hideSysNetFlag, usernsFlag, sysfsFlag)
	}
	// LOWER: one directory, or several joined by ':' (topmost first), as overlayfs's
	// lowerdir; each is checked by mountLayers.
	lowers, upper, work, target := strings.Split(args[0], ":"), args[1], args[2], args[3]
	prog, err := exec.LookPath(args[5])
	if err != nil {
		return err
	}
	// unshare and mount apply to this thread; exec then carries its
	// namespace into the new program.
	if err := privateMounts(); err != nil {
		return err
	}
	if hide {
		if err := hideSysNet(); err != nil {
			return err
		}
	}
	var ns *userns
	if ids != nil {
		made, err := newUserns(*ids)
		if err != nil {
			return err
		}
		ns = made
	}
	if err := mountLayers(lowers, upper, work, target, ns); err != nil {
		return err
	}
	if sysfs != "" {
		if err := mountSysfs(sysfs, filepath.Join(target, "sys"), ns); err != nil {
			return err
		}
	}
	return syscall.Exec(prog, args[5:], os.Environ())
}

// hideSysNetExec is `sandmand hide-sys-net -- PROG ARGS...`: PROG runs in a
// private mount namespace where /proc/sys/net is an empty read-only tmpfs.
//
// Debian 12's runsc (2022) tells the root network namespace by
// /proc/sys/net/core/rmem_default existing; since Linux 6.x that file is in
// every namespace, so with --network=sandbox it refuses to start or restore
// any sandbox ("cannot run with network enabled in root network
// namespace"). The sandbox's own namespace is never the root one (the
// provider made it), so hiding the file from runsc alone is safe; nothing
// on the host changes.
func hideSysNetExec(args []string) error {
	if len(args) < 2 || args[0] != "--" {
		return fmt.Errorf("usage: sandmand hide-sys-net -- PROG [ARGS...]")
	}
	prog, err := exec.LookPath(args[1])
	if err != nil {
		return err
	}
	if err := privateMounts(); err != nil {
		return err
	}
	if err := hideSysNet(); err != nil {
		return err
	}
	return syscall.Exec(prog, args[1:], os.Environ())
}

// privateMounts moves this thread into a new mount namespace whose mounts
// propagate nowhere.
func privateMounts() error {
	runtime.LockOSThread()
	if err := syscall.Unshare(syscall.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare(CLONE_NEWNS): %w", err)
	}
	if err := syscall.Mount("none", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	return nil
}

func hideSysNet() error {
	if err := syscall.Mount("none", "/proc/sys/net", "tmpfs", syscall.MS_RDONLY|syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, "size=4k"); err != nil {
		return fmt.Errorf("mount a tmpfs over /proc/sys/net: %w", err)
	}
	return nil
}
