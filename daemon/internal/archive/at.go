package archive

import (
	"syscall"
	"unsafe"
)

// The *at calls the syscall package lacks. Every one acts on a name inside a
// directory descriptor and never follows a final symlink, so an upload can be
// walked component by component without any path being resolved by name.

func symlinkat(target string, dirfd int, name string) error {
	t, err := syscall.BytePtrFromString(target)
	if err != nil {
		return err
	}
	n, err := syscall.BytePtrFromString(name)
	if err != nil {
		return err
	}
	_, _, e := syscall.Syscall(syscall.SYS_SYMLINKAT, uintptr(unsafe.Pointer(t)), uintptr(dirfd), uintptr(unsafe.Pointer(n)))
	if e != 0 {
		return e
	}
	return nil
}

// linkat hard-links oldname (itself, never what it may point to) as newname.
func linkat(olddirfd int, oldname string, newdirfd int, newname string) error {
	o, err := syscall.BytePtrFromString(oldname)
	if err != nil {
		return err
	}
	n, err := syscall.BytePtrFromString(newname)
	if err != nil {
		return err
	}
	_, _, e := syscall.Syscall6(syscall.SYS_LINKAT, uintptr(olddirfd), uintptr(unsafe.Pointer(o)), uintptr(newdirfd), uintptr(unsafe.Pointer(n)), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// readlinkat is the target of symlink name, or an error (EINVAL: not a symlink).
func readlinkat(dirfd int, name string) (string, error) {
	n, err := syscall.BytePtrFromString(name)
	if err != nil {
		return "", err
	}
	buf := make([]byte, 4096)
	r, _, e := syscall.Syscall6(syscall.SYS_READLINKAT, uintptr(dirfd), uintptr(unsafe.Pointer(n)), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), 0, 0)
	if e != 0 {
		return "", e
	}
	return string(buf[:r]), nil
}

// lstatat stats name in dirfd without following it.
func lstatat(dirfd int, name string, st *syscall.Stat_t) error {
	return fstatat(dirfd, name, st, atSymlinkNoFollow)
}

const (
	atSymlinkNoFollow = 0x100
	atRemoveDir       = 0x200
)

func unlinkat(dirfd int, name string, flags int) error {
	n, err := syscall.BytePtrFromString(name)
	if err != nil {
		return err
	}
	_, _, e := syscall.Syscall(syscall.SYS_UNLINKAT, uintptr(dirfd), uintptr(unsafe.Pointer(n)), uintptr(flags))
	if e != 0 {
		return e
	}
	return nil
}

// oPath is O_PATH (0x200000 on every architecture Go supports on Linux but
// sparc64); the syscall package does not export it everywhere.
const oPath = 0x200000

// fstatat through an O_PATH descriptor: the syscall package exports no
// fstatat on amd64. Only AT_SYMLINK_NOFOLLOW is supported in flags.
func fstatat(dirfd int, name string, st *syscall.Stat_t, flags int) error {
	open := oPath | syscall.O_CLOEXEC
	if flags&atSymlinkNoFollow != 0 {
		open |= syscall.O_NOFOLLOW
	}
	fd, err := syscall.Openat(dirfd, name, open, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	return syscall.Fstat(fd, st)
}
