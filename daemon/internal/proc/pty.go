package proc

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"unsafe"

	"sandman/daemon/internal/apierr"
)

// DefaultRows and DefaultCols size a terminal whose size was not given.
const (
	DefaultRows = 24
	DefaultCols = 80
)

// WinSize is a terminal's size in character cells.
type WinSize struct {
	Rows, Cols uint16
}

// winsize is struct winsize of <asm-generic/termios.h>.
type winsize struct {
	Row, Col, Xpixel, Ypixel uint16
}

// ptmxPaths are tried in order: /dev/ptmx is the usual node (or a symlink
// into the devpts instance); a /dev without it still has the instance's own.
var ptmxPaths = []string{"/dev/ptmx", "/dev/pts/ptmx"}

// openPTY allocates a pseudo-terminal of the given size. The master is
// opened O_CLOEXEC (os.OpenFile always is) and the slave O_CLOEXEC|O_NOCTTY,
// so neither leaks into other children and the daemon never acquires a
// controlling terminal; the slave reaches the child only through ForkExec's
// Files, which dup2 it onto 0, 1 and 2.
func openPTY(size WinSize) (master, slave *os.File, err error) {
	for _, p := range ptmxPaths {
		master, err = os.OpenFile(p, os.O_RDWR|syscall.O_NOCTTY, 0)
		if err == nil || !errors.Is(err, os.ErrNotExist) {
			break
		}
	}
	if err != nil {
		return nil, nil, apierr.New(500, "pty_unavailable", "cannot allocate a pseudo-terminal: %v", err)
	}
	defer func() {
		if err != nil {
			master.Close()
		}
	}()
	var unlock int32
	if err = ioctl(master, syscall.TIOCSPTLCK, unsafe.Pointer(&unlock)); err != nil {
		return nil, nil, fmt.Errorf("unlocking the pty: %w", err)
	}
	var n uint32
	if err = ioctl(master, syscall.TIOCGPTN, unsafe.Pointer(&n)); err != nil {
		return nil, nil, fmt.Errorf("numbering the pty: %w", err)
	}
	if err = setSize(master, size); err != nil {
		return nil, nil, err
	}
	name := "/dev/pts/" + strconv.FormatUint(uint64(n), 10)
	fd, err := syscall.Open(name, syscall.O_RDWR|syscall.O_NOCTTY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("opening %s: %w", name, err)
	}
	return master, os.NewFile(uintptr(fd), name), nil
}

// setSize sets the terminal's size; the kernel sends SIGWINCH to its
// foreground process group when the size changes.
func setSize(master *os.File, size WinSize) error {
	ws := winsize{Row: size.Rows, Col: size.Cols}
	if err := ioctl(master, syscall.TIOCSWINSZ, unsafe.Pointer(&ws)); err != nil {
		return fmt.Errorf("resizing the pty: %w", err)
	}
	return nil
}

// ioctl runs one ioctl on f's descriptor. Through SyscallConn, so a
// concurrent Close cannot hand the number to another file meanwhile; on a
// closed file it returns os.ErrClosed.
func ioctl(f *os.File, req uintptr, arg unsafe.Pointer) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var errno syscall.Errno
	if err := rc.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, req, uintptr(arg))
	}); err != nil {
		return err
	}
	if errno != 0 {
		return errno
	}
	return nil
}

// dupFile duplicates f's descriptor (close-on-exec), so the pty's writer
// can be closed apart from its reader.
func dupFile(f *os.File) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var fd int
	var derr error
	if err := rc.Control(func(old uintptr) {
		fd, derr = dupCloexec(int(old))
	}); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, derr
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

func dupCloexec(fd int) (int, error) {
	r, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), syscall.F_DUPFD_CLOEXEC, 0)
	if errno != 0 {
		return -1, errno
	}
	return int(r), nil
}

// startTTY launches c on a fresh pseudo-terminal: the slave is its stdin,
// stdout and stderr and its controlling terminal. The returned stdout is the
// master (the terminal's output) and stdin a duplicate of it (the keyboard).
func (r *Runner) startTTY(c *Command, size WinSize) (*started, error) {
	l, err := r.resolve(c)
	if err != nil {
		return nil, err
	}
	master, slave, err := openPTY(size)
	if err != nil {
		return nil, err
	}
	if l.cred != nil {
		// The terminal belongs to whoever runs on it, as login and sshd do.
		_ = slave.Chown(int(l.cred.Uid), -1)
	}
	in, err := dupFile(master)
	if err != nil {
		master.Close()
		slave.Close()
		return nil, err
	}
	fd := slave.Fd()
	child, err := r.reaper.StartTTY(l.path, l.argv, l.env, c.Dir, []uintptr{fd, fd, fd}, l.cred)
	// Only the child holds the slave now: once it and its descendants have
	// closed it, reading the master ends (EIO).
	slave.Close()
	if err != nil {
		master.Close()
		in.Close()
		return nil, forkFailed(l, err)
	}
	r.adjustOOM(child.Pid)
	return &started{child: child, stdout: master, stdin: in, id: l.id}, nil
}
