// Package proc runs commands: one-shot execs (buffered or streamed),
// background processes and persistent shells. Every child is started
// through the reaper, in its own process group.
package proc

import (
	"errors"
	"net/http"
	"os"
	"strconv"
	"syscall"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/reaper"
)

// Command says what to run. Exactly one of Argv and Cmd is set; Cmd runs as
// Shell -c Cmd.
type Command struct {
	Argv  []string
	Cmd   *string
	Shell string
	Dir   string
	Env   map[string]string
	// User, if set, is who the command runs as ("name", "uid", "name:group",
	// "uid:gid"), resolved in the sandbox's /etc/passwd and /etc/group.
	User string
	// MergeStderr gives the command one pipe for both stdout and stderr: one
	// interleaved stream, reported as stdout.
	MergeStderr bool
}

// DefaultShell runs Command.Cmd when Shell is empty.
const DefaultShell = "/bin/sh"

func (c *Command) argv() []string {
	if c.Cmd != nil {
		sh := c.Shell
		if sh == "" {
			sh = DefaultShell
		}
		return []string{sh, "-c", *c.Cmd}
	}
	return c.Argv
}

// Runner starts children.
type Runner struct {
	reaper  *reaper.Reaper
	baseEnv []string
	devNull *os.File // shared read-only stdin for children that get none
	// ChildOOMScoreAdj, if not zero, is set on every child (see server.Options).
	ChildOOMScoreAdj int
	// Etc is the directory whose passwd and group files resolve
	// Command.User ("/etc"; tests point it elsewhere).
	Etc       string
	canSwitch bool // may set a child's uid, gid and groups
}

// NewRunner refuses a nil reaper: without it nobody would reap the children.
func NewRunner(r *reaper.Reaper, baseEnv []string) (*Runner, error) {
	if r == nil {
		return nil, errors.New("proc: nil reaper")
	}
	// A rootfs without /dev/null is tolerated: stdin then comes from an
	// empty pipe (see nullStdin).
	dn, _ := os.Open(os.DevNull)
	return &Runner{reaper: r, baseEnv: baseEnv, devNull: dn, Etc: "/etc", canSwitch: canSwitchUser()}, nil
}

// Reaper is the runner's reaper.
func (r *Runner) Reaper() *reaper.Reaper { return r.reaper }

// started is a running child and the parent's ends of its pipes.
type started struct {
	child  *reaper.Child
	stdout *os.File
	stderr *os.File
	stdin  *os.File  // write end; nil unless a stdin pipe was asked for
	id     *identity // nil: the daemon's own user
}

// checkDir turns a bad cwd into a 4xx before anything is forked.
func checkDir(dir string) error {
	if dir == "" {
		return nil
	}
	st, err := os.Stat(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return apierr.NotFound("cwd %s does not exist", dir)
		}
		return apierr.FromOS(err)
	}
	if !st.IsDir() {
		return apierr.New(400, "not_a_directory", "cwd %s is not a directory", dir)
	}
	return nil
}

// launch is what a resolved Command starts with.
type launch struct {
	path string
	argv []string
	env  []string
	cred *syscall.Credential // nil: the daemon's own
	id   *identity           // nil without Command.User
}

// resolve does what both launches (start, startTTY) do before forking:
// refuse a bad cwd, resolve the user (its HOME goes under the request's env),
// build the environment and argv, and find the program (a *LaunchError means
// "report 126/127").
func (r *Runner) resolve(c *Command) (*launch, error) {
	if err := checkDir(c.Dir); err != nil {
		return nil, err
	}
	l := &launch{env: r.baseEnv}
	if c.User != "" {
		id, err := lookupUser(r.Etc, c.User)
		if err != nil {
			return nil, err
		}
		if l.cred, err = r.credential(id); err != nil {
			return nil, err
		}
		l.id = id
		l.env = mergeEnv(l.env, map[string]string{"HOME": id.home})
	}
	l.env = mergeEnv(l.env, c.Env)
	l.argv = c.argv()
	path, lerr := lookPath(l.argv[0], l.env, c.Dir)
	if lerr != nil {
		return nil, lerr
	}
	l.path = path
	return l, nil
}

// start launches c with fresh stdout/stderr pipes (one pipe for both with
// MergeStderr: stderr is then nil). stdinPipe asks for a stdin pipe;
// otherwise stdin is /dev/null. A *LaunchError means "report 126/127".
func (r *Runner) start(c *Command, stdinPipe bool) (*started, error) {
	l, err := r.resolve(c)
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW := (*os.File)(nil), outW
	if !c.MergeStderr {
		if errR, errW, err = os.Pipe(); err != nil {
			outR.Close()
			outW.Close()
			return nil, err
		}
	}
	var inR, inW *os.File
	if stdinPipe {
		inR, inW, err = os.Pipe()
	} else {
		inR, err = r.nullStdin()
	}
	if err != nil {
		outR.Close()
		outW.Close()
		if errR != nil {
			errR.Close()
			errW.Close()
		}
		return nil, err
	}
	child, err := r.reaper.Start(l.path, l.argv, l.env, c.Dir,
		[]uintptr{inR.Fd(), outW.Fd(), errW.Fd()}, l.cred)
	outW.Close()
	if errR != nil {
		errW.Close()
	}
	if inR != r.devNull {
		inR.Close()
	}
	if err != nil {
		outR.Close()
		if errR != nil {
			errR.Close()
		}
		if inW != nil {
			inW.Close()
		}
		return nil, forkFailed(l, err)
	}
	r.adjustOOM(child.Pid)
	return &started{child: child, stdout: outR, stderr: errR, stdin: inW, id: l.id}, nil
}

// forkFailed reports a failed exec as the exit code a shell would give, and
// a refused change of user as permission_denied.
func forkFailed(l *launch, err error) error {
	if l.cred != nil && errors.Is(err, syscall.EPERM) {
		return apierr.New(http.StatusForbidden, "permission_denied",
			"cannot run commands as %s: %v", l.id.spec, err)
	}
	code := 126
	if errors.Is(err, syscall.ENOENT) {
		code = 127 // e.g. a script whose interpreter is missing
	}
	return launchErr(code, l.argv[0], err.Error())
}

func (r *Runner) adjustOOM(pid int) {
	if r.ChildOOMScoreAdj != 0 {
		// Best effort: a child that already exited has no such file.
		_ = os.WriteFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj",
			[]byte(strconv.Itoa(r.ChildOOMScoreAdj)), 0)
	}
}

func (r *Runner) nullStdin() (*os.File, error) {
	if r.devNull != nil {
		return r.devNull, nil
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	pw.Close()
	return pr, nil
}
