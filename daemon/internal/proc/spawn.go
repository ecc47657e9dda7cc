// Package proc runs commands: one-shot execs (buffered or streamed),
// background processes and persistent shell sessions. Every child is started
// through the reaper, in its own process group.
package proc

import (
	"errors"
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
}

// NewRunner refuses a nil reaper: without it nobody would reap the children.
func NewRunner(r *reaper.Reaper, baseEnv []string) (*Runner, error) {
	if r == nil {
		return nil, errors.New("proc: nil reaper")
	}
	// A rootfs without /dev/null is tolerated: stdin then comes from an
	// empty pipe (see nullStdin).
	dn, _ := os.Open(os.DevNull)
	return &Runner{reaper: r, baseEnv: baseEnv, devNull: dn}, nil
}

// Reaper is the runner's reaper.
func (r *Runner) Reaper() *reaper.Reaper { return r.reaper }

// started is a running child and the parent's ends of its pipes.
type started struct {
	child  *reaper.Child
	stdout *os.File
	stderr *os.File
	stdin  *os.File // write end; nil unless a stdin pipe was asked for
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

// resolve does what both launches (start, startTTY) do before forking:
// refuse a bad cwd, build the environment and argv, and find the program
// (a *LaunchError means "report 126/127").
func (r *Runner) resolve(c *Command) (path string, argv, env []string, err error) {
	if err := checkDir(c.Dir); err != nil {
		return "", nil, nil, err
	}
	env = mergeEnv(r.baseEnv, c.Env)
	argv = c.argv()
	path, lerr := lookPath(argv[0], env, c.Dir)
	if lerr != nil {
		return "", nil, nil, lerr
	}
	return path, argv, env, nil
}

// start launches c with fresh stdout/stderr pipes. stdinPipe asks for a stdin
// pipe; otherwise stdin is /dev/null. A *LaunchError means "report 126/127".
func (r *Runner) start(c *Command, stdinPipe bool) (*started, error) {
	path, argv, env, err := r.resolve(c)
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, err
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
		errR.Close()
		errW.Close()
		return nil, err
	}
	child, err := r.reaper.Start(path, argv, env, c.Dir,
		[]uintptr{inR.Fd(), outW.Fd(), errW.Fd()})
	outW.Close()
	errW.Close()
	if inR != r.devNull {
		inR.Close()
	}
	if err != nil {
		outR.Close()
		errR.Close()
		if inW != nil {
			inW.Close()
		}
		return nil, forkFailed(argv[0], err)
	}
	r.adjustOOM(child.Pid)
	return &started{child: child, stdout: outR, stderr: errR, stdin: inW}, nil
}

// forkFailed reports a failed exec as the exit code a shell would give.
func forkFailed(name string, err error) *LaunchError {
	code := 126
	if errors.Is(err, syscall.ENOENT) {
		code = 127 // e.g. a script whose interpreter is missing
	}
	return launchErr(code, name, err.Error())
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
