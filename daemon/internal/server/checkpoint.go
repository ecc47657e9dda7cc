package server

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"sandman/daemon/internal/apierr"
)

// Checkpoints (gVisor's `runsc checkpoint`): a TCP endpoint that a task
// waits on (every socket Go's poller holds, every socket in an epoll set)
// cannot be saved, and a failed checkpoint kills the sandbox. So before one,
// the host asks the daemon to stop serving (POST /v1/checkpoint/prepare):
// it refuses while the workload holds TCP sockets of its own or requests
// are in flight, else it closes its listeners, idle connections and
// tunnels, answers, and closes the asking connection too. After the
// restore, the host sends SIGUSR2 and the daemon listens again (Resume).

// drainGrace is how long, once the listeners are closed, the connections
// that raced the prepare get to finish their request.
const drainGrace = time.Second

// Listeners is what the daemon's main loop lends the server so that a
// checkpoint can stop the serving and a restore restart it.
type Listeners interface {
	// Close closes every listening socket (connections are refused) and
	// the idle keep-alive connections; active ones close after their answer.
	Close()
	// Open listens on the same addresses again.
	Open() error
}

// conns counts the HTTP connections of the server that are open and not
// hijacked, and among them those not idle (a request in flight). The
// daemon's main loop installs Server.ConnState on its http.Server.
type conns struct {
	mu    sync.Mutex
	state map[net.Conn]http.ConnState
}

// ConnState is the http.Server hook that keeps the count of connections.
func (s *Server) ConnState(c net.Conn, st http.ConnState) {
	markIdle(c, st)
	s.conns.mu.Lock()
	defer s.conns.mu.Unlock()
	switch st {
	case http.StateClosed, http.StateHijacked:
		delete(s.conns.state, c)
	default:
		if s.conns.state == nil {
			s.conns.state = map[net.Conn]http.ConnState{}
		}
		s.conns.state[c] = st
	}
}

// counts returns the open connections and those with a request in flight.
func (cs *conns) counts() (open, busy int) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	for _, st := range cs.state {
		if st != http.StateIdle {
			busy++
		}
	}
	return len(cs.state), busy
}

func notCheckpointable(format string, args ...any) *apierr.Error {
	return apierr.New(http.StatusConflict, "not_checkpointable", format, args...)
}

// checkpointPrepare serves POST /v1/checkpoint/prepare.
func (s *Server) checkpointPrepare(w http.ResponseWriter, r *http.Request, _ string) error {
	if s.listeners == nil {
		return notCheckpointable("this daemon cannot stop serving (no listeners lent to it)")
	}
	s.ckptMu.Lock()
	defer s.ckptMu.Unlock()
	if s.quiesced {
		return notCheckpointable("already prepared: waiting for SIGUSR2")
	}
	holders, err := tcpHolders(os.Getpid())
	if err != nil {
		return apierr.Internal("listing the sandbox's TCP sockets: %v", err)
	}
	if len(holders) > 0 {
		return notCheckpointable("TCP sockets are open in the sandbox (gVisor cannot checkpoint them): %s",
			describeHolders(holders))
	}
	// This request's own connection is one of them.
	if _, busy := s.conns.counts(); busy > 1 {
		return notCheckpointable("%d other requests to the daemon are in flight", busy-1)
	}
	s.listeners.Close()
	s.tunnels.shut()
	deadline := time.Now().Add(drainGrace)
	for {
		open, _ := s.conns.counts()
		if open <= 1 {
			break
		}
		if time.Now().After(deadline) {
			_ = s.resume()
			return notCheckpointable("%d other requests to the daemon did not finish within %v", open-1, drainGrace)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The answer goes on a connection taken over. The host reads it, then
	// shuts its side down; the daemon then closes with a reset (no TIME_WAIT,
	// see AbortIdle). When the host sees its end, the daemon holds no TCP
	// socket at all.
	conn, buffered, err := http.NewResponseController(w).Hijack()
	if err != nil {
		_ = s.resume()
		return apierr.Internal("cannot take the connection over: %v", err)
	}
	s.quiesced = true
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = io.WriteString(conn, "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
	_, _ = io.Copy(io.Discard, buffered) // until the host's end (or the deadline)
	if ac, ok := conn.(*abortConn); ok {
		ac.abort.Store(true)
	}
	conn.Close()
	s.log.Printf("prepared for a checkpoint: not serving until SIGUSR2")
	return nil
}

// Resume serves again after a checkpoint (the daemon got SIGUSR2): it
// listens on its addresses and accepts tunnels again. Without a prepare
// before, it does nothing.
func (s *Server) Resume() error {
	s.ckptMu.Lock()
	defer s.ckptMu.Unlock()
	if !s.quiesced {
		return nil
	}
	if err := s.resume(); err != nil {
		return err
	}
	s.quiesced = false
	return nil
}

func (s *Server) resume() error {
	s.tunnels.reopen()
	return s.listeners.Open()
}

// Quiesced reports whether the daemon is prepared for a checkpoint (not serving).
func (s *Server) Quiesced() bool {
	s.ckptMu.Lock()
	defer s.ckptMu.Unlock()
	return s.quiesced
}

// TokenRequest is the body of POST /v1/token.
type TokenRequest struct {
	Token *string `json:"token"`
}

const (
	minToken = 16
	maxToken = 4096
)

func parseToken(data []byte) (string, error) {
	var req TokenRequest
	if err := decodeJSON(data, &req); err != nil {
		return "", err
	}
	if req.Token == nil {
		return "", apierr.InvalidRequest("token is required")
	}
	tok := *req.Token
	if len(tok) < minToken || len(tok) > maxToken {
		return "", apierr.InvalidRequest("token must be %d..%d characters", minToken, maxToken)
	}
	for i := 0; i < len(tok); i++ {
		if tok[i] <= ' ' || tok[i] > '~' {
			return "", apierr.InvalidRequest("token must be printable ASCII without spaces")
		}
	}
	return tok, nil
}

// tokenReplace serves POST /v1/token: from the answer on, only the new
// token is accepted (a sandbox restored from another's memory gets its own).
func (s *Server) tokenReplace(w http.ResponseWriter, r *http.Request, _ string) error {
	tok, err := readParsed(w, r, parseToken)
	if err != nil {
		return err
	}
	if s.auth.Load() == nil {
		return apierr.InvalidRequest("this daemon serves without a token (--no-auth)")
	}
	auth := []byte("Bearer " + tok)
	s.auth.Store(&auth)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// describeHolders names each process and its sockets, for the refusal.
func describeHolders(holders map[int][]string) string {
	var parts []string
	for _, pid := range sortedPids(holders) {
		parts = append(parts, "pid "+itoa(pid)+" ("+comm(pid)+"): "+strings.Join(holders[pid], ", "))
	}
	return strings.Join(parts, "; ")
}

// AbortIdle wraps a listener so that the connections the daemon closes while
// idle (keep-alive timeout, the prepare's sweep) end with a reset, not a FIN.
// A TCP endpoint that closed first lingers in TIME_WAIT (60 s in gVisor's
// stack), and gVisor refuses to save one ("endpoint cannot be saved in
// connected state"): a checkpoint within a minute of any such close would
// fail and kill the sandbox. An idle connection has nothing in flight, so
// the reset loses nothing; one in use closes as it always did.
func AbortIdle(ln net.Listener) net.Listener { return abortListener{ln} }

type abortListener struct{ net.Listener }

func (l abortListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	ac := &abortConn{Conn: c}
	ac.abort.Store(true) // nothing sent on it yet
	return ac, nil
}

// SyscallConn reaches the socket under the wrapper (shutdown's SHUT_RD).
func (l abortListener) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := l.Listener.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.New("not a socket")
}

type abortConn struct {
	net.Conn
	abort atomic.Bool
}

func (c *abortConn) Close() error {
	if c.abort.Load() {
		if tc, ok := c.Conn.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
	}
	return c.Conn.Close()
}

// markIdle tells an abortConn whether it is idle (see AbortIdle).
func markIdle(c net.Conn, st http.ConnState) {
	if ac, ok := c.(*abortConn); ok {
		ac.abort.Store(st == http.StateIdle || st == http.StateNew)
	}
}
