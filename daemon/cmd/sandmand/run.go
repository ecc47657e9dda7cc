package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"sandman/daemon/internal/proc"
	"sandman/daemon/internal/reaper"
	"sandman/daemon/internal/server"
)

// parseAddr splits unix:/path or tcp:host:port into a net network/address.
func parseAddr(a string) (network, addr string, err error) {
	switch {
	case strings.HasPrefix(a, "unix:") && len(a) > len("unix:"):
		return "unix", a[len("unix:"):], nil
	case strings.HasPrefix(a, "fd:"):
		if n, err := strconv.Atoi(a[len("fd:"):]); err != nil || n < 3 {
			return "", "", fmt.Errorf("bad --listen %q: want fd:N with N >= 3", a)
		}
		return "fd", a[len("fd:"):], nil
	case strings.HasPrefix(a, "tcp:"):
		if _, _, err := net.SplitHostPort(a[len("tcp:"):]); err != nil {
			return "", "", fmt.Errorf("bad --listen %q: %v", a, err)
		}
		return "tcp", a[len("tcp:"):], nil
	}
	return "", "", fmt.Errorf("bad --listen %q: want unix:/path, tcp:host:port or fd:N", a)
}

func listen(a string) (net.Listener, string, error) {
	network, addr, err := parseAddr(a)
	if err != nil {
		return nil, "", err
	}
	if network == "fd" {
		return listenFD(addr)
	}
	if network == "unix" {
		// A socket left by an earlier run would make bind fail; anything
		// else at that path is not ours to remove.
		if fi, err := os.Lstat(addr); err == nil && fi.Mode()&os.ModeSocket != 0 {
			_ = os.Remove(addr)
		}
		if err := os.MkdirAll(filepath.Dir(addr), 0o755); err != nil {
			return nil, "", err
		}
		ln, err := net.Listen("unix", addr)
		if err != nil {
			return nil, "", err
		}
		return ln, "unix:" + addr, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", err
	}
	return ln, "tcp:" + ln.Addr().String(), nil
}

// listenFD serves on a socket the host created and bound where no sandbox
// can write (socket activation): the host then never follows a path the
// workload controls. listen(2) is ours, so the kernel records this process
// as the peer that the host checks with SO_PEERCRED.
func listenFD(num string) (net.Listener, string, error) {
	fd, _ := strconv.Atoi(num)
	if err := syscall.Listen(fd, 4096); err != nil {
		return nil, "", fmt.Errorf("listen on descriptor %d: %w", fd, err)
	}
	f := os.NewFile(uintptr(fd), "listen-fd")
	defer f.Close() // FileListener holds its own (close-on-exec) copy
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, "", fmt.Errorf("descriptor %d: %w", fd, err)
	}
	return ln, "fd:" + num + " (" + ln.Addr().String() + ")", nil
}

func run(cfg config, logger *log.Logger) error {
	if err := becomeUndumpable(); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE, 0): %w", err)
	}
	if os.Getenv("GOMAXPROCS") == "" {
		// One P unless told otherwise: the daemon mostly waits, and on the
		// small VMs sandboxes run in, idle Ps spinning for work steal the
		// CPU the command needs. Measured on 2 vCPUs: exec of /bin/true
		// costs ~50 us over a bare fork/exec with one P, ~130 us with two.
		runtime.GOMAXPROCS(1)
	}
	if err := reaper.BecomeSubreaper(); err != nil {
		logger.Printf("cannot become a child subreaper (orphans will not be reaped): %v", err)
	}
	rp := reaper.New()
	srv, err := server.New(server.Options{
		Token: cfg.token, NoAuth: cfg.noAuth, Version: version,
		KillGrace: cfg.killGrace, Reaper: rp, Env: proc.DaemonEnv(), Log: logger,
		ChildOOMScoreAdj: cfg.childOOMScoreAdj,
	})
	if err != nil {
		return err
	}
	// Handle the signals before listening: as PID 1 an unhandled SIGTERM is
	// simply dropped by the kernel.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)

	hs := &http.Server{Handler: srv, ErrorLog: logger}
	var sockets []string
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			l.Close()
		}
		for _, p := range sockets {
			_ = os.Remove(p)
		}
	}()
	serveErr := make(chan error, len(cfg.listen))
	for _, a := range cfg.listen {
		ln, name, err := listen(a)
		if err != nil {
			return err
		}
		listeners = append(listeners, ln)
		if strings.HasPrefix(name, "unix:") {
			sockets = append(sockets, name[len("unix:"):])
		}
		fmt.Fprintf(os.Stderr, "sandmand: listening on %s\n", name)
		go func() { serveErr <- hs.Serve(ln) }()
	}

	select {
	case sig := <-sigs:
		logger.Printf("got %v, shutting down", sig)
	case err := <-serveErr:
		return fmt.Errorf("serving: %w", err)
	}
	hs.SetKeepAlivesEnabled(false)
	for _, l := range listeners {
		l.Close()
	}
	stopChildren(rp, cfg.shutdownGrace)
	// Let handlers of killed commands write their results, briefly.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := hs.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		logger.Printf("shutdown: %v", err)
	}
	hs.Close()
	return nil
}

// stopChildren sends SIGTERM to every child's process group, waits up to
// grace for them to exit, SIGKILLs what is left, then drains orphans.
func stopChildren(rp *reaper.Reaper, grace time.Duration) {
	// Orphans (re-parented to us, maybe in groups of their own) and the
	// zombies of killed ones: none may outlive the daemon.
	defer rp.Drain(time.Second)
	rp.SignalAll(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-rp.Idle():
		return
	case <-t.C:
	}
	rp.SignalAll(syscall.SIGKILL)
	k := time.NewTimer(time.Second)
	defer k.Stop()
	select {
	case <-rp.Idle():
	case <-k.C:
	}
}
