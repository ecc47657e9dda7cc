package proc

import (
	"syscall"
	"testing"
	"unsafe"
)

func TestOpenPTYSizeAndCloexec(t *testing.T) {
	master, slave, err := openPTY(WinSize{Rows: 33, Cols: 111})
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	defer slave.Close()
	var ws winsize
	if err := ioctl(slave, syscall.TIOCGWINSZ, unsafe.Pointer(&ws)); err != nil {
		t.Fatal(err)
	}
	if ws.Row != 33 || ws.Col != 111 {
		t.Fatalf("size %dx%d, want 33x111", ws.Row, ws.Col)
	}
	if err := setSize(master, WinSize{Rows: 5, Cols: 7}); err != nil {
		t.Fatal(err)
	}
	if err := ioctl(slave, syscall.TIOCGWINSZ, unsafe.Pointer(&ws)); err != nil || ws.Row != 5 || ws.Col != 7 {
		t.Fatalf("after resize: %dx%d, %v", ws.Row, ws.Col, err)
	}
	in, err := dupFile(master)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	// No descriptor of the terminal may reach a child but through Files.
	for _, f := range []interface{ Fd() uintptr }{master, slave, in} {
		flags, _, errno := syscall.Syscall(syscall.SYS_FCNTL, f.Fd(), syscall.F_GETFD, 0)
		if errno != 0 || flags&syscall.FD_CLOEXEC == 0 {
			t.Fatalf("fd %d: flags %#x, %v: not close-on-exec", f.Fd(), flags, errno)
		}
	}
	// Typed bytes come back as the terminal's echo.
	if _, err := in.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 8)
	if n, err := master.Read(buf); err != nil || string(buf[:n]) != "x" {
		t.Fatalf("echo: %q, %v", buf[:n], err)
	}
}
