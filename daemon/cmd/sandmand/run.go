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
	"sync"
	"syscall"
	"time"

	"sandman/daemon/internal/freeze"
	"sandman/daemon/internal/proc"
	"sandman/daemon/internal/reaper"
	"sandman/daemon/internal/server"
)

// Bounds of the HTTP server. Request bodies and answers have none (no
// ReadTimeout or WriteTimeout): uploads, downloads, streamed commands and
// long polls last as long as they do.
const (
	// defaultReadHeaderTimeout is how long a connection may take to send a
	// request's headers: from accept for its first request, from the first
	// byte for later ones. The SDK writes a request's head in one send, so
	// this is margin for a host stalled (GC, swap, a loaded node) between
	// connect and send; a client that trickles headers, or connects and
	// sends nothing, holds a connection no longer than this.
	defaultReadHeaderTimeout = 10 * time.Second
	// defaultIdleTimeout is how long a keep-alive connection may wait for its
	// next request. It frees the connections of clients that went away or
	// forgot them. The pause it must outlast is an agent's turn between two
	// calls (model generation: seconds, sometimes minutes): a connection in
	// use is never cut. Past it, the client's next call pays one reconnect
	// (~0.1 ms on the unix socket) after a pause of minutes, and the SDK
	// resends a request that met a connection closed while idle. A request
	// in flight, however long, is never idle.
	defaultIdleTimeout = 5 * time.Minute
	// answerGrace is how long, once the children are stopped, the requests
	// still running (mostly those that waited on them) get to answer before
	// their connections are closed.
	answerGrace = time.Second
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
// as the peer that the host checks with SO_PEERCRED. The descriptor itself
// stays open (close-on-exec) so that the daemon can serve on it again
// after a checkpoint (listenerSet.Open).
func listenFD(num string) (net.Listener, string, error) {
	fd, _ := strconv.Atoi(num)
	if err := syscall.Listen(fd, 4096); err != nil {
		return nil, "", fmt.Errorf("listen on descriptor %d: %w", fd, err)
	}
	f := passedFDs[fd]
	if f == nil {
		// Kept for good: a dropped *os.File's finalizer would close the descriptor.
		syscall.CloseOnExec(fd)
		f = os.NewFile(uintptr(fd), "listen-fd")
		passedFDs[fd] = f
	}
	ln, err := net.FileListener(f) // its own (close-on-exec) copy
	if err != nil {
		return nil, "", fmt.Errorf("descriptor %d: %w", fd, err)
	}
	return ln, "fd:" + num + " (" + ln.Addr().String() + ")", nil
}

// passedFDs holds the sockets passed as fd:N, by number.
var passedFDs = map[int]*os.File{}

// listenerSet is the daemon's listening sockets, served by one http.Server;
// the server closes and reopens them around a checkpoint (server.Listeners).
type listenerSet struct {
	addrs   []string
	hs      *http.Server
	errs    chan error
	mu      sync.Mutex
	open    []net.Listener
	sockets []string // unix socket paths to remove at exit
	closed  bool     // by Close, for a checkpoint: Serve's error is expected
	gen     int      // how many times Close was called
}

// Open listens on every address and serves each.
func (ls *listenerSet) Open() error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.hs.SetKeepAlivesEnabled(true)
	for i, a := range ls.addrs {
		raw, name, err := listen(a)
		if err != nil {
			for _, l := range ls.open {
				l.Close()
			}
			ls.open = nil
			return err
		}
		ln := server.AbortIdle(raw)
		ls.open = append(ls.open, ln)
		if strings.HasPrefix(a, "tcp:") {
			ls.addrs[i] = name // the port chosen for :0, kept for the next Open
		}
		if strings.HasPrefix(name, "unix:") {
			ls.sockets = append(ls.sockets, name[len("unix:"):])
		}
		fmt.Fprintf(os.Stderr, "sandmand: listening on %s\n", name)
		go func(gen int) {
			err := ls.hs.Serve(ln)
			ls.mu.Lock()
			expected := ls.closed || ls.gen != gen
			ls.mu.Unlock()
			if !expected {
				ls.errs <- err
			}
		}(ls.gen)
	}
	ls.closed = false
	return nil
}

// Close closes the listening sockets and the idle connections (a
// checkpoint's prepare); connections in use close after their answer.
func (ls *listenerSet) Close() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.closed = true
	ls.gen++
	for _, l := range ls.open {
		l.Close()
	}
	ls.open = nil
	ls.hs.SetKeepAlivesEnabled(false)
}

// current returns the open listeners (for shutdown).
func (ls *listenerSet) current() []net.Listener {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.closed = true // from now on Serve returning is no error
	return append([]net.Listener(nil), ls.open...)
}

func (ls *listenerSet) removeSockets() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, l := range ls.open {
		l.Close()
	}
	for _, p := range ls.sockets {
		_ = os.Remove(p)
	}
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
	hs := &http.Server{
		ErrorLog:          logger,
		ReadHeaderTimeout: cfg.readHeaderTimeout, IdleTimeout: cfg.idleTimeout,
	}
	ls := &listenerSet{addrs: append([]string(nil), cfg.listen...), hs: hs, errs: make(chan error, len(cfg.listen))}
	srv, err := server.New(server.Options{
		Token: cfg.token, NoAuth: cfg.noAuth, Version: version,
		KillGrace: cfg.killGrace, Reaper: rp, Env: proc.DaemonEnv(), Log: logger,
		ChildOOMScoreAdj: cfg.childOOMScoreAdj, Listeners: ls, ChangesRoot: "/",
		// As PID 1 every process of the pid namespace is the sandbox's.
		Freezer: freeze.New(freeze.Options{
			Self: os.Getpid(), All: os.Getpid() == 1, Usage: freeze.CgroupUsage("/sys/fs/cgroup"),
		}),
	})
	if err != nil {
		return err
	}
	hs.Handler = srv
	hs.ConnState = srv.ConnState
	// Handle the signals before listening: as PID 1 an unhandled SIGTERM is
	// simply dropped by the kernel. SIGUSR2: serve again after a checkpoint
	// (the host sends it to the restored sandbox, `runsc kill ID USR2`).
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	resume := make(chan os.Signal, 1)
	signal.Notify(resume, syscall.SIGUSR2)

	defer ls.removeSockets()
	if err := ls.Open(); err != nil {
		return err
	}
	for {
		select {
		case sig := <-sigs:
			logger.Printf("got %v, shutting down", sig)
			shutdown(hs, srv, ls.current(), rp, cfg.shutdownGrace, logger)
			return nil
		case <-resume:
			if !srv.Quiesced() {
				continue
			}
			if err := srv.Resume(); err != nil {
				return fmt.Errorf("serving again after a checkpoint: %w", err)
			}
			logger.Printf("serving again after a checkpoint")
		case err := <-ls.errs:
			return fmt.Errorf("serving: %w", err)
		}
	}
}

// shutdown stops in order. First it stops accepting: the listening sockets
// refuse connections, idle keep-alive connections are closed (a client
// reusing one sees it closed before any answer, and may resend), a
// connection in use closes after its answer, and connections to ports in
// the sandbox (tunnels) are closed. Then it stops the processes
// it started, so that requests waiting on them (an exec, a wait, a long
// poll) answer; they get answerGrace to do so, then whatever connection is
// left is closed. A request already read when this began may still start a
// process after the SIGTERM: the SIGKILL after the grace ends it.
func shutdown(hs *http.Server, srv *server.Server, listeners []net.Listener, rp *reaper.Reaper, grace time.Duration, logger *log.Logger) {
	for _, l := range listeners {
		stopListening(l)
	}
	hs.SetKeepAlivesEnabled(false) // closes the idle connections
	srv.CloseTunnels()             // http.Server no longer knows hijacked connections
	srv.Unpause()                  // stopped processes would not heed the SIGTERM
	stopChildren(rp, grace)
	ctx, cancel := context.WithTimeout(context.Background(), answerGrace)
	defer cancel()
	// Shutdown reports the listeners it finds closed already; only its
	// deadline matters here.
	if err := hs.Shutdown(ctx); errors.Is(err, context.DeadlineExceeded) {
		logger.Printf("requests still running %v after the children stopped: closing their connections", answerGrace)
	}
	hs.Close()
}

// stopListening makes l refuse connections at once, then closes it.
// Closing alone is not enough for a socket passed as fd:N: while the host
// (or anyone it passed the socket to) holds a copy, the socket stays in
// listen state and connections queue up with no one to accept them, so the
// client waits out its own timeout. shutdown(SHUT_RD) on a listening socket
// makes connect fail with ECONNREFUSED, whoever holds it.
func stopListening(l net.Listener) {
	if sc, ok := l.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			_ = raw.Control(func(fd uintptr) { _ = syscall.Shutdown(int(fd), syscall.SHUT_RD) })
		}
	}
	l.Close()
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
