package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

// A sandbox's user namespace (`overlay-exec --userns`): root inside is an
// unprivileged host uid range of the sandbox's own, and the namespace is OWNED by
// the first uid of that range. The kernel charges per-user limits (inotify
// instances and watches, user namespaces, mqueue bytes, RLIMIT_NPROC...) up the
// user-namespace chain to the owner of each namespace: a namespace made by root (as
// `crun` would make it) charges every sandbox to root, and one sandbox holding root's
// 128 inotify instances fails every other sandbox and root on the host. Owned by
// the sandbox's uid, each sandbox has its own 128.

// The system calls of the new mount API, the same number on every architecture.
const (
	sysOpenTree     = 428
	sysMoveMount    = 429
	sysMountSetattr = 442

	openTreeClone       = 0x1
	atEmptyPath         = 0x1000
	moveMountFEmptyPath = 0x4
	mountAttrIdmap      = 0x100000

	prGetSecurebits     = 27
	prSetSecurebits     = 28
	secbitNoSetuidFixup = 1 << 2
	sigSetmask          = 2
)

// usernsFlag is `--userns=BASE:SIZE:PATH`: container ids 0..SIZE-1 are host ids
// BASE..BASE+SIZE-1 (uids and gids alike), the namespace is owned by BASE, and it is
// bound at PATH (an existing file) in overlay-exec's private mount namespace, for the
// runtime to join (`{"type": "user", "path": PATH}`); the binding goes with that
// namespace, so nothing is left on the host.
const usernsFlag = "--userns="

// userns is one sandbox's user namespace, open.
type userns struct {
	fd   int
	base uint32
}

type idRange struct {
	base, size uint32
	path       string
}

func parseUserns(value string) (idRange, error) {
	parts := strings.SplitN(value, ":", 3)
	if len(parts) != 3 || parts[2] == "" {
		return idRange{}, fmt.Errorf("%sBASE:SIZE:PATH, not %q", usernsFlag, value)
	}
	base, err1 := strconv.ParseUint(parts[0], 10, 32)
	size, err2 := strconv.ParseUint(parts[1], 10, 32)
	// Root inside must never be root outside, and the range must fit below (uid_t)-1.
	if err1 != nil || err2 != nil || base == 0 || size == 0 || base+size > 1<<32-1 {
		return idRange{}, fmt.Errorf("bad id range %q in %s", parts[0]+":"+parts[1], usernsFlag)
	}
	return idRange{base: uint32(base), size: uint32(size), path: parts[2]}, nil
}

// newUserns makes the user namespace of r, owned by r.base, and binds it at r.path.
// Call it in overlay-exec's private mount namespace, on its locked OS thread: the
// owner is set by switching this thread's (and only this thread's) effective ids
// around the clone that makes the namespace.
func newUserns(r idRange) (*userns, error) {
	var pid int
	err := asOwner(r.base, func() error {
		var err error
		pid, err = holdNewUserns()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("make a user namespace: %w", err)
	}
	defer func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		var status syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &status, 0, nil)
	}()
	proc := "/proc/" + strconv.Itoa(pid) + "/"
	mapping := fmt.Sprintf("0 %d %d\n", r.base, r.size)
	for _, name := range []string{"uid_map", "gid_map"} {
		if err := os.WriteFile(proc+name, []byte(mapping), 0); err != nil {
			return nil, fmt.Errorf("write %s: %w", name, err)
		}
	}
	fd, err := syscall.Open(proc+"ns/user", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open the user namespace: %w", err)
	}
	if err := syscall.Mount("/proc/self/fd/"+strconv.Itoa(fd), r.path, "", syscall.MS_BIND, ""); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("bind the user namespace at %s: %w", r.path, err)
	}
	return &userns{fd: fd, base: r.base}, nil
}

// holdNewUserns forks a process in a new user namespace that does nothing until it
// is killed: the namespace lives while it does, until newUserns holds it. A fork
// without an exec (Go could only exec a program, whose start would cost more than
// all the rest of a create's user namespace): every signal is blocked across the
// clone, and the child runs nothing but raw system calls (`userNamespaceHolder`).
func holdNewUserns() (int, error) {
	all, old := ^uint64(0), uint64(0)
	if _, _, e := syscall.RawSyscall6(syscall.SYS_RT_SIGPROCMASK, sigSetmask, uintptr(unsafe.Pointer(&all)), uintptr(unsafe.Pointer(&old)), 8, 0, 0); e != 0 {
		return 0, fmt.Errorf("rt_sigprocmask: %w", e)
	}
	pid, e := userNamespaceHolder(uintptr(syscall.Getpid()))
	syscall.RawSyscall6(syscall.SYS_RT_SIGPROCMASK, sigSetmask, uintptr(unsafe.Pointer(&old)), 0, 8, 0, 0)
	if e != 0 {
		return 0, fmt.Errorf("clone: %w", e)
	}
	return int(pid), nil
}

// userNamespaceHolder is clone(CLONE_NEWUSER) from this thread. In the parent it
// returns the child's pid. The child, a copy of this thread alone in the new
// namespace, never returns: like the child half of Go's own forkAndExecInChild it
// may only make raw system calls (no allocation, no lock, no stack growth), and it
// waits for SIGKILL, from us or (PR_SET_PDEATHSIG) on our thread's death.
//
//go:nosplit
//go:norace
func userNamespaceHolder(parent uintptr) (uintptr, syscall.Errno) {
	pid, _, e := syscall.RawSyscall6(syscall.SYS_CLONE, syscall.CLONE_NEWUSER|uintptr(syscall.SIGCHLD), 0, 0, 0, 0, 0)
	if e != 0 || pid != 0 {
		return pid, e
	}
	syscall.RawSyscall(syscall.SYS_PRCTL, syscall.PR_SET_PDEATHSIG, uintptr(syscall.SIGKILL), 0)
	if ppid, _, _ := syscall.RawSyscall(syscall.SYS_GETPPID, 0, 0, 0); ppid != parent {
		syscall.RawSyscall(syscall.SYS_EXIT_GROUP, 0, 0, 0) // orphaned before the prctl
	}
	for {
		syscall.RawSyscall6(syscall.SYS_PPOLL, 0, 0, 0, 0, 0, 0)
	}
}

// asOwner runs f with this OS thread's effective uid and gid set to id (the real and
// saved ids stay root's, so they can be set back): a user namespace made by f (a
// clone with CLONE_NEWUSER on this thread) is owned by id. The raw system calls
// change this thread alone; Go's syscall.Setresuid would change every thread. The
// thread keeps its capabilities meanwhile (SECBIT_NO_SETUID_FIXUP): hosts that
// restrict user namespaces made without CAP_SYS_ADMIN (Ubuntu's AppArmor, Debian's
// unprivileged_userns_clone) let root make this one.
func asOwner(id uint32, f func() error) error {
	return keepingCaps(func() error {
		const keep = ^uintptr(0)
		if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESGID, keep, uintptr(id), keep); e != 0 {
			return fmt.Errorf("setresgid: %w", e)
		}
		if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, keep, uintptr(id), keep); e != 0 {
			if back := restoreIDs(); back != nil {
				return back
			}
			return fmt.Errorf("setresuid: %w", e)
		}
		err := f()
		if back := restoreIDs(); back != nil {
			// This thread must not go on with another identity: overlay-exec fails.
			return back
		}
		return err
	})
}

// keepingCaps runs f with SECBIT_NO_SETUID_FIXUP set on this thread: changing its
// (effective or filesystem) uid away from 0 and back leaves its capabilities alone.
func keepingCaps(f func() error) error {
	old, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prGetSecurebits, 0, 0)
	if e != 0 {
		return fmt.Errorf("prctl(PR_GET_SECUREBITS): %w", e)
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetSecurebits, old|secbitNoSetuidFixup, 0); e != 0 {
		return fmt.Errorf("prctl(PR_SET_SECUREBITS): %w", e)
	}
	err := f()
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetSecurebits, old, 0); e != 0 {
		return fmt.Errorf("prctl(PR_SET_SECUREBITS): %w", e)
	}
	return err
}

func restoreIDs() error {
	const keep = ^uintptr(0)
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, keep, 0, keep); e != 0 {
		return fmt.Errorf("set the effective uid back: %w", e)
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESGID, keep, 0, keep); e != 0 {
		return fmt.Errorf("set the effective gid back: %w", e)
	}
	return nil
}

// withFsids runs f with this thread's filesystem uid and gid set to id, every
// capability kept (SECBIT_NO_SETUID_FIXUP). overlayfs acts on its upper layer with
// the credentials of whoever mounted it: mounted so, what it makes there itself (its
// work directory, whiteouts, copied-up files before their owner is set) is made as
// container root, which the idmapped upper stores as 0. As host root (unmapped in the
// sandbox's namespace) it could make nothing there at all.
func withFsids(id uint32, f func() error) error {
	err := keepingCaps(func() error {
		syscall.RawSyscall(syscall.SYS_SETFSGID, uintptr(id), 0, 0)
		syscall.RawSyscall(syscall.SYS_SETFSUID, uintptr(id), 0, 0)
		err := f()
		syscall.RawSyscall(syscall.SYS_SETFSUID, 0, 0, 0)
		syscall.RawSyscall(syscall.SYS_SETFSGID, 0, 0, 0)
		return err
	})
	// setfsuid answers the previous id whatever happens: read it back to be sure.
	if uid, _, _ := syscall.RawSyscall(syscall.SYS_SETFSUID, ^uintptr(0), 0, 0); uid != 0 {
		return fmt.Errorf("the filesystem uid stayed %d", uid)
	}
	if gid, _, _ := syscall.RawSyscall(syscall.SYS_SETFSGID, ^uintptr(0), 0, 0); gid != 0 {
		return fmt.Errorf("the filesystem gid stayed %d", gid)
	}
	return err
}

type mountAttr struct {
	attrSet     uint64
	attrClr     uint64
	propagation uint64
	usernsFd    uint64
}

// bindIdmapped binds source at point, its ids shifted by ns: a file that says uid N
// on disk is uid N inside the sandbox (host uid base+N), and what the sandbox writes
// as its uid N is stored as N. The layers stay shared by every sandbox of an image,
// never copied nor chowned.
func bindIdmapped(source, point string, ns *userns) error {
	path, err := syscall.BytePtrFromString(source)
	if err != nil {
		return err
	}
	fd, _, e := syscall.Syscall(sysOpenTree, fdcwd(), uintptr(unsafe.Pointer(path)), openTreeClone|syscall.O_CLOEXEC)
	if e != 0 {
		return fmt.Errorf("open_tree %s: %w", source, e)
	}
	defer syscall.Close(int(fd))
	attr := mountAttr{attrSet: mountAttrIdmap, usernsFd: uint64(ns.fd)}
	empty, _ := syscall.BytePtrFromString("")
	if _, _, e := syscall.Syscall6(sysMountSetattr, fd, uintptr(unsafe.Pointer(empty)), atEmptyPath, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr), 0); e != 0 {
		return fmt.Errorf("idmap %s (mount_setattr): %w", source, e)
	}
	target, err := syscall.BytePtrFromString(point)
	if err != nil {
		return err
	}
	if _, _, e := syscall.Syscall6(sysMoveMount, fd, uintptr(unsafe.Pointer(empty)), fdcwd(), uintptr(unsafe.Pointer(target)), moveMountFEmptyPath, 0); e != 0 {
		return fmt.Errorf("move_mount %s: %w", source, e)
	}
	return nil
}

// mountSysfs mounts, read-only at target, the sysfs of the network namespace at
// netns (ns: the sandbox's user namespace, or nil). The runtime cannot: a network
// namespace the host made (before the sandbox's user namespace existed) is not the
// sandbox's to mount sysfs for, and crun then binds the host's /sys, which names the
// host's interfaces. The kernel keeps one sysfs superblock per network namespace, so
// sandboxes given one shared namespace here share one superblock.
func mountSysfs(netns, target string, ns *userns) error {
	if _, err := os.Lstat(target); os.IsNotExist(err) {
		// Made through the overlay as container root, like any mount point crun makes.
		mkdir := func() error { return os.Mkdir(target, 0o555) }
		if ns != nil {
			err = withFsids(ns.base, mkdir)
		} else {
			err = mkdir()
		}
		if err != nil {
			return err
		}
	}
	self, err := syscall.Open("/proc/thread-self/ns/net", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(self)
	fd, err := syscall.Open(netns, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", netns, err)
	}
	defer syscall.Close(fd)
	if err := setns(fd, syscall.CLONE_NEWNET); err != nil {
		return fmt.Errorf("join %s: %w", netns, err)
	}
	mountErr := syscall.Mount("sysfs", target, "sysfs", syscall.MS_RDONLY|syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, "")
	if err := setns(self, syscall.CLONE_NEWNET); err != nil {
		return fmt.Errorf("back to the host's network namespace: %w", err)
	}
	if mountErr != nil {
		return fmt.Errorf("mount sysfs at %s: %w", target, mountErr)
	}
	return nil
}

// fdcwd is AT_FDCWD as a system call argument (a negative int).
func fdcwd() uintptr {
	at := -100 // AT_FDCWD
	return uintptr(at)
}

// sysSetns is setns(2)'s number, which Go's syscall package does not name.
var sysSetns = map[string]uintptr{"amd64": 308, "arm64": 268, "riscv64": 268, "386": 346, "arm": 375, "ppc64le": 350, "s390x": 339}[runtime.GOARCH]

func setns(fd, kind int) error {
	if sysSetns == 0 {
		return fmt.Errorf("setns: unknown on %s", runtime.GOARCH)
	}
	if _, _, e := syscall.RawSyscall(sysSetns, uintptr(fd), uintptr(kind), 0); e != 0 {
		return e
	}
	return nil
}
