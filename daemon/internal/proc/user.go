package proc

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"sandman/daemon/internal/apierr"
)

// maxUserDB bounds what is read of /etc/passwd and /etc/group: the sandbox
// writes them, and a huge one must not cost the daemon its memory.
const maxUserDB = 16 << 20

// identity is who a child runs as, resolved from a request's user.
type identity struct {
	uid, gid uint32
	groups   []uint32 // supplementary groups, the primary one included
	home     string
	name     string // from passwd; empty for a uid it does not list
	spec     string // as the request spelled it, for messages
}

// Who is the user a process or shell was started as: uid, gid and the
// name passwd gives the uid ("" when it lists none).
type Who struct {
	UID, GID uint32
	Name     string
}

// whoOf is who a launch runs as: the resolved user, else the daemon itself.
func (r *Runner) whoOf(id *identity) Who {
	if id != nil {
		return Who{UID: id.uid, GID: id.gid, Name: id.name}
	}
	uid := uint32(os.Getuid())
	w := Who{UID: uid, GID: uint32(os.Getgid())}
	// Best effort: a passwd that cannot be read leaves the name unknown.
	if passwd, err := readUserDB(filepath.Join(r.Etc, "passwd")); err == nil {
		if e := findEntry(passwd, 2, strconv.FormatUint(uint64(uid), 10)); e != nil {
			w.Name = e[0]
		}
	}
	return w
}

// WhoWouldRun is who c would run as, for a command that could not be
// launched (its user resolved, its program not found): the daemon itself if
// the user cannot be resolved either.
func (r *Runner) WhoWouldRun(c *Command) Who {
	if c.User == "" {
		return r.whoOf(nil)
	}
	id, err := lookupUser(r.Etc, c.User)
	if err != nil {
		return r.whoOf(nil)
	}
	return r.whoOf(id)
}

// errUnknownUser is the code of a user or group the sandbox does not know.
func errUnknownUser(format string, args ...any) error {
	return apierr.New(http.StatusNotFound, "unknown_user", format, args...)
}

// lookupUser resolves spec ("name", "uid", "name:group", "uid:gid") in the
// passwd and group files under etc, the way docker and runc do: a name must
// be in passwd; a uid need not be (gid 0, HOME /); a group given explicitly
// is the only group, otherwise the primary group and every group that lists
// the user's name as a member. The files are read on every call: a command
// may have just added the user.
func lookupUser(etc, spec string) (*identity, error) {
	name, group, hasGroup := strings.Cut(spec, ":")
	id := &identity{home: "/", spec: spec}
	passwd, err := readUserDB(filepath.Join(etc, "passwd"))
	if err != nil {
		return nil, err
	}
	var entry []string
	if uid, ok := parseID(name); ok {
		id.uid = uid
		entry = findEntry(passwd, 2, name)
	} else {
		entry = findEntry(passwd, 0, name)
		if entry == nil {
			return nil, errUnknownUser("unable to find user %s: no matching entries in passwd file", name)
		}
		uid, ok := parseID(entry[2])
		if !ok {
			return nil, errUnknownUser("user %s has an invalid uid %q in the passwd file", name, entry[2])
		}
		id.uid = uid
	}
	if entry != nil {
		id.name = entry[0]
		if gid, ok := parseID(entry[3]); ok {
			id.gid = gid
		}
		if len(entry) > 5 && entry[5] != "" {
			id.home = entry[5]
		}
	}
	var groups [][]string
	if hasGroup || entry != nil {
		if groups, err = readUserDB(filepath.Join(etc, "group")); err != nil {
			return nil, err
		}
	}
	switch {
	case hasGroup:
		if gid, ok := parseID(group); ok {
			id.gid = gid
		} else {
			g := findEntry(groups, 0, group)
			if g == nil {
				return nil, errUnknownUser("unable to find group %s: no matching entries in group file", group)
			}
			gid, ok := parseID(g[2])
			if !ok {
				return nil, errUnknownUser("group %s has an invalid gid %q in the group file", group, g[2])
			}
			id.gid = gid
		}
		id.groups = []uint32{id.gid}
	case entry != nil:
		id.groups = []uint32{id.gid}
		for _, g := range groups {
			if len(g) < 4 || !memberOf(g[3], entry[0]) {
				continue
			}
			if gid, ok := parseID(g[2]); ok && !containsID(id.groups, gid) {
				id.groups = append(id.groups, gid)
			}
		}
	default:
		id.groups = []uint32{id.gid}
	}
	return id, nil
}

// CheckUserSpec is the request-time check of a user field: its shape only,
// the lookup happens when the command starts.
func CheckUserSpec(spec string) error {
	name, group, hasGroup := strings.Cut(spec, ":")
	switch {
	case name == "":
		return apierr.InvalidRequest("user is empty")
	case hasGroup && group == "":
		return apierr.InvalidRequest("user %q has an empty group", spec)
	case strings.ContainsAny(spec, "\x00\n") || strings.Count(spec, ":") > 1:
		return apierr.InvalidRequest("user must be name, uid, name:group or uid:gid")
	}
	if isDigits(name) {
		if _, ok := parseID(name); !ok {
			return apierr.InvalidRequest("uid %s is out of range", name)
		}
	}
	if hasGroup && isDigits(group) {
		if _, ok := parseID(group); !ok {
			return apierr.InvalidRequest("gid %s is out of range", group)
		}
	}
	return nil
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// parseID reads a uid or gid: decimal, below 2^32-1 (which means "none").
func parseID(s string) (uint32, bool) {
	if !isDigits(s) {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || n == 1<<32-1 {
		return 0, false
	}
	return uint32(n), true
}

func containsID(ids []uint32, id uint32) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

func memberOf(members, name string) bool {
	for _, m := range strings.Split(members, ",") {
		if strings.TrimSpace(m) == name {
			return true
		}
	}
	return false
}

// findEntry is the first entry whose field i is value (passwd: 7 fields,
// group: 4; shorter lines are not entries).
func findEntry(entries [][]string, i int, value string) []string {
	for _, e := range entries {
		if len(e) >= 4 && e[i] == value {
			return e
		}
	}
	return nil
}

// readUserDB reads the colon-separated entries of a passwd or group file; a
// missing file has none. Only a regular file is read (opened non-blocking,
// so a fifo put there cannot hang the request), and only its first
// maxUserDB bytes.
func readUserDB(path string) ([][]string, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
			return nil, nil
		}
		return nil, apierr.Internal("reading %s: %v", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, apierr.Internal("reading %s: %v", path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, errUnknownUser("%s is not a regular file", path)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxUserDB))
	if err != nil {
		return nil, apierr.Internal("reading %s: %v", path, err)
	}
	var entries [][]string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), maxUserDB)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		entries = append(entries, strings.Split(line, ":"))
	}
	return entries, nil
}

// capSetUID and capSetGID are bits of /proc/self/status CapEff.
const (
	capSetGID = 6
	capSetUID = 7
)

// canSwitchUser reports whether this process may change its children's
// uid, gid and groups: CAP_SETUID and CAP_SETGID in its effective set (root
// in a container usually has them; a daemon started as another user does not).
func canSwitchUser() bool {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return os.Geteuid() == 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return os.Geteuid() == 0
			}
			return caps&(1<<capSetUID) != 0 && caps&(1<<capSetGID) != 0
		}
	}
	return os.Geteuid() == 0
}

// credential is how the child gets id: nil when it already is who the daemon
// is (no change needed), else the uid, gid and groups to set. A daemon
// without the privilege to switch refuses any other identity.
func (r *Runner) credential(id *identity) (*syscall.Credential, error) {
	if id == nil {
		return nil, nil
	}
	if !r.canSwitch {
		if id.uid == uint32(os.Getuid()) && id.gid == uint32(os.Getgid()) {
			return nil, nil
		}
		return nil, apierr.New(http.StatusForbidden, "permission_denied",
			"sandmand runs as uid %d without CAP_SETUID/CAP_SETGID: it cannot run commands as %s",
			os.Getuid(), id.spec)
	}
	return &syscall.Credential{Uid: id.uid, Gid: id.gid, Groups: id.groups}, nil
}
