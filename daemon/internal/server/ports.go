package server

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"sandman/daemon/internal/apierr"
)

// portDialTimeout bounds connecting to a port inside the sandbox. Loopback
// answers at once (accepted or refused); only a listener whose backlog is
// full leaves a connect waiting.
const portDialTimeout = 10 * time.Second

// switched is the whole answer that hands the connection over to the port.
const switched = "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"

// tunnels holds the connections handed over to ports, so that shutdown can
// close them: http.Server forgets a connection once it is hijacked.
type tunnels struct {
	mu     sync.Mutex
	open   map[*tunnel]struct{}
	closed bool
}

// tunnel is one client connection joined to one connection to a port.
type tunnel struct {
	client, target net.Conn
	once           sync.Once
}

func (t *tunnel) close() {
	t.once.Do(func() {
		t.client.Close()
		t.target.Close()
	})
}

// add registers t; false once the daemon is shutting down.
func (ts *tunnels) add(t *tunnel) bool {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.closed {
		return false
	}
	if ts.open == nil {
		ts.open = map[*tunnel]struct{}{}
	}
	ts.open[t] = struct{}{}
	return true
}

func (ts *tunnels) remove(t *tunnel) {
	ts.mu.Lock()
	delete(ts.open, t)
	ts.mu.Unlock()
}

// CloseTunnels closes every connection handed over to a port and refuses
// new ones (at shutdown).
func (s *Server) CloseTunnels() { s.tunnels.shut() }

// shut closes every tunnel and refuses new ones until reopen.
func (ts *tunnels) shut() {
	ts.mu.Lock()
	ts.closed = true
	open := ts.open
	ts.open = nil
	ts.mu.Unlock()
	for t := range open {
		t.close()
	}
}

// reopen accepts tunnels again (after a checkpoint).
func (ts *tunnels) reopen() {
	ts.mu.Lock()
	ts.closed = false
	ts.mu.Unlock()
}

// Tunnels is the number of connections handed over to ports and still open.
func (s *Server) Tunnels() int {
	s.tunnels.mu.Lock()
	defer s.tunnels.mu.Unlock()
	return len(s.tunnels.open)
}

// hasToken reports whether the comma-separated header values hold token
// (case-insensitive), as Connection and Upgrade are written.
func hasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// portConnect serves GET /v1/ports/{port}/connect: it connects to the port on
// the sandbox's loopback, answers 101 and from then on copies bytes both ways
// between the client's connection and the port's. Everything that can fail
// (a bad port, no upgrade asked, nothing listening) fails before the 101,
// as an ordinary error answer.
func (s *Server) portConnect(w http.ResponseWriter, r *http.Request, id string) error {
	port, err := strconv.ParseUint(id, 10, 16)
	if err != nil || port == 0 {
		return apierr.InvalidRequest("port must be a number in 1..65535, got %q", id)
	}
	if !hasToken(r.Header, "Connection", "upgrade") || !hasToken(r.Header, "Upgrade", "tcp") {
		return apierr.InvalidRequest("connecting to a port needs Connection: Upgrade and Upgrade: tcp")
	}
	if r.ContentLength != 0 || len(r.TransferEncoding) > 0 {
		// Its bytes would be taken for the tunnel's.
		return apierr.InvalidRequest("connecting to a port takes no request body")
	}
	target, err := dialLoopback(r.Context(), int(port))
	if err != nil {
		return err
	}
	conn, buffered, err := http.NewResponseController(w).Hijack()
	if err != nil {
		target.Close()
		return apierr.Internal("cannot take the connection over: %v", err)
	}
	t := &tunnel{client: conn, target: target}
	if !s.tunnels.add(t) {
		t.close() // shutting down: the client sees the connection close
		return nil
	}
	defer s.tunnels.remove(t)
	defer t.close()
	// The server's read deadline (ReadHeaderTimeout) stays on a hijacked
	// connection; a tunnel is idle as long as its ends are.
	_ = conn.SetDeadline(time.Time{})
	if _, err := io.WriteString(conn, switched); err != nil {
		return nil
	}
	// Bytes the client sent right behind its request are the tunnel's first.
	if n := buffered.Reader.Buffered(); n > 0 {
		early, _ := buffered.Reader.Peek(n)
		if _, err := target.Write(early); err != nil {
			return nil
		}
	}
	join(conn, target)
	return nil
}

// dialLoopback connects to port on 127.0.0.1, or on ::1 if nothing listens
// there (a server bound to "localhost" may have taken either).
func dialLoopback(ctx context.Context, port int) (net.Conn, error) {
	d := net.Dialer{Timeout: portDialTimeout}
	p := strconv.Itoa(port)
	conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", p))
	if errors.Is(err, syscall.ECONNREFUSED) {
		if c6, err6 := d.DialContext(ctx, "tcp", net.JoinHostPort("::1", p)); err6 == nil {
			return c6, nil
		}
	}
	if err == nil {
		return conn, nil
	}
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return nil, apierr.New(http.StatusBadGateway, "connection_refused",
			"nothing listens on port %d in the sandbox (127.0.0.1 and ::1 refused)", port)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled), isTimeout(err):
		return nil, apierr.New(http.StatusGatewayTimeout, "connect_timeout",
			"port %d in the sandbox did not accept a connection within %v", port, portDialTimeout)
	}
	return nil, apierr.New(http.StatusBadGateway, "connection_refused",
		"cannot connect to port %d in the sandbox: %v", port, err)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

type closeWriter interface{ CloseWrite() error }

// join copies bytes both ways until both directions have ended. The end of
// one direction (its source's EOF) is passed on as a half-close, so a client
// that shuts down its writing still gets the answer; a failure in either
// direction closes both connections.
func join(a, b net.Conn) {
	done := make(chan struct{})
	var fail sync.Once
	failed := func() {
		fail.Do(func() {
			a.Close()
			b.Close()
		})
	}
	pump := func(dst, src net.Conn) {
		if _, err := io.Copy(dst, src); err != nil {
			failed()
			return
		}
		if cw, ok := dst.(closeWriter); ok {
			if cw.CloseWrite() == nil {
				return
			}
		}
		failed()
	}
	go func() {
		defer close(done)
		pump(b, a)
	}()
	pump(a, b)
	<-done
}
