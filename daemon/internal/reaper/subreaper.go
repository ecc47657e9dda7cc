package reaper

import (
	"os"
	"syscall"
)

const prSetChildSubreaper = 36

// BecomeSubreaper makes orphans of our descendants re-parent to this process
// when it is not PID 1 (as PID 1 they already do).
func BecomeSubreaper() error {
	if os.Getpid() == 1 {
		return nil
	}
	_, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0)
	if errno != 0 {
		return errno
	}
	return nil
}
