package proc

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// defaultPath is used for lookup when the child's environment has no PATH,
// as a shell would.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// DaemonEnv is the environment children inherit: ours minus every SANDMAND_*
// variable, so the token never leaks into a command.
func DaemonEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SANDMAND_") {
			env = append(env, kv)
		}
	}
	return env
}

// mergeEnv returns base with extra applied on top (extra wins).
func mergeEnv(base []string, extra map[string]string) []string {
	if len(extra) == 0 {
		return base
	}
	env := make([]string, 0, len(base)+len(extra))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if _, over := extra[k]; !over {
			env = append(env, kv)
		}
	}
	keys := make([]string, 0, len(extra))
	for k := range extra {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+extra[k])
	}
	return env
}

func lookupEnv(env []string, key string) (string, bool) {
	val, found := "", false
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			val, found = v, true // the last one wins, as in getenv of most libcs
		}
	}
	return val, found
}

// LaunchError means the command could not be started; it becomes an exit
// code (127 not found, 126 not executable) with Msg on stderr, not an HTTP
// error.
type LaunchError struct {
	Code int
	Msg  string
}

func (e *LaunchError) Error() string { return e.Msg }

func launchErr(code int, name, reason string) *LaunchError {
	return &LaunchError{Code: code, Msg: "sandmand: " + name + ": " + reason + "\n"}
}

// lookPath resolves name like a shell does, but on the PATH of the child's
// environment and relative to the child's working directory.
func lookPath(name string, env []string, dir string) (string, *LaunchError) {
	if name == "" {
		return "", launchErr(127, name, "command not found")
	}
	if strings.Contains(name, "/") {
		switch err := checkExecutable(inDir(dir, name)); err {
		case nil:
			return inDir(dir, name), nil
		case syscall.ENOENT, syscall.ENOTDIR:
			return "", launchErr(127, name, "command not found")
		default:
			return "", launchErr(126, name, err.Error())
		}
	}
	path, ok := lookupEnv(env, "PATH")
	if !ok {
		path = defaultPath
	}
	var denied error
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			d = "."
		}
		cand := inDir(dir, filepath.Join(d, name))
		err := checkExecutable(cand)
		if err == nil {
			return cand, nil
		}
		if err != syscall.ENOENT && err != syscall.ENOTDIR && denied == nil {
			denied = err
		}
	}
	if denied != nil {
		return "", launchErr(126, name, denied.Error())
	}
	return "", launchErr(127, name, "command not found")
}

func inDir(dir, p string) string {
	if dir == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(dir, p)
}

// checkExecutable returns nil, ENOENT/ENOTDIR (keep looking), or why the file
// cannot be run.
func checkExecutable(p string) error {
	var st syscall.Stat_t
	if err := syscall.Stat(p, &st); err != nil {
		if err == syscall.ENOENT || err == syscall.ENOTDIR {
			return err
		}
		return err
	}
	if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
		return syscall.EISDIR
	}
	if st.Mode&0o111 == 0 {
		return syscall.EACCES
	}
	return nil
}
