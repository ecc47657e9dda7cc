package server

import (
	"net/http"
	"sort"
	"strings"

	"sandman/daemon/internal/apierr"
)

// handler serves one route; params holds the {id} segment, if any.
type handler func(w http.ResponseWriter, r *http.Request, id string) error

type route struct {
	method  string
	pattern string // segments; "{id}" matches one non-empty segment
	public  bool   // no auth
	h       handler
}

// RouteInfo names one registered route, for the spec coverage test.
type RouteInfo struct{ Method, Pattern string }

func matchPattern(pattern, path string) (id string, ok bool) {
	ps := strings.Split(pattern, "/")
	ss := strings.Split(path, "/")
	if len(ps) != len(ss) {
		return "", false
	}
	for i := range ps {
		if ps[i] == "{id}" {
			if ss[i] == "" {
				return "", false
			}
			id = ss[i]
		} else if ps[i] != ss[i] {
			return "", false
		}
	}
	return id, true
}

// find returns the route for method and path. A path known under other
// methods is 405; an unknown path is 404 unknown_route.
func (s *Server) find(method, path string) (*route, string, error) {
	var allow []string
	for i := range s.routes {
		rt := &s.routes[i]
		id, ok := matchPattern(rt.pattern, path)
		if !ok {
			continue
		}
		if rt.method == method {
			return rt, id, nil
		}
		allow = append(allow, rt.method)
	}
	if allow != nil {
		sort.Strings(allow)
		return nil, strings.Join(allow, ", "), apierr.New(http.StatusMethodNotAllowed, "method_not_allowed", "%s is not allowed on %s", method, path)
	}
	return nil, "", apierr.New(http.StatusNotFound, "unknown_route", "no endpoint %s", path)
}

// Routes lists what the server serves.
func (s *Server) Routes() []RouteInfo {
	out := make([]RouteInfo, len(s.routes))
	for i, rt := range s.routes {
		out[i] = RouteInfo{rt.method, rt.pattern}
	}
	return out
}
