// Command sandmand is the in-sandbox daemon of Sandman: PID 1 of the
// sandbox container, it runs commands, shells and file operations for the
// client over HTTP (protocol v1, see daemon/PROTOCOL.md).
package main

import (
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"time"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// config is everything run needs, parsed from flags and the environment.
type config struct {
	listen        []string
	token         string
	noAuth        bool
	killGrace     time.Duration
	shutdownGrace time.Duration
	// readHeaderTimeout and idleTimeout bound connections that send
	// nothing (see run.go for the values).
	readHeaderTimeout time.Duration
	idleTimeout       time.Duration
	// childOOMScoreAdj makes the OOM killer prefer commands over the daemon.
	childOOMScoreAdj int
}

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	logger := log.New(os.Stderr, "sandmand: ", 0)
	if len(os.Args) > 1 && os.Args[1] == "overlay-exec" {
		err := overlayExec(os.Args[2:])
		logger.Print(err) // only reached when the exec did not happen
		os.Exit(125)
	}
	if len(os.Args) > 1 && os.Args[1] == "hide-sys-net" {
		err := hideSysNetExec(os.Args[2:])
		logger.Print(err) // only reached when the exec did not happen
		os.Exit(125)
	}
	if len(os.Args) > 1 && os.Args[1] == "install" {
		if err := install(os.Args[2:]); err != nil {
			logger.Print(err)
			os.Exit(1)
		}
		return
	}
	// The token in the environment stays readable in /proc/self/environ
	// after Unsetenv (the kernel keeps the original block): run again without
	// it, the token handed over on a pipe.
	if err := reexecWithoutSecrets(); err != nil {
		logger.Print(err)
		os.Exit(2)
	}
	cfg, err := parseFlags(os.Args[1:], "")
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if errors.Is(err, errVersion) {
		fmt.Println(version)
		return
	}
	if err != nil {
		logger.Print(err)
		os.Exit(2)
	}
	if err := run(cfg, logger); err != nil {
		logger.Print(err)
		os.Exit(1)
	}
}

var errVersion = errors.New("version asked")

func parseFlags(args []string, envToken string) (config, error) {
	var cfg config
	var listen listFlag
	fs := flag.NewFlagSet("sandmand", flag.ContinueOnError)
	fs.Var(&listen, "listen", "address to serve on, unix:/path, tcp:host:port or fd:N (a bound unix socket passed by the host) (repeatable)")
	tokenFile := fs.String("token-file", "", "file holding the bearer token (else --token-fd, else $SANDMAND_TOKEN)")
	tokenFD := fs.Int("token-fd", -1, "descriptor to read the bearer token from (then closed), as the local provider passes it")
	envTokenFD := fs.Int("env-token-fd", -1, "internal: where a re-executed daemon finds $SANDMAND_TOKEN")
	fs.BoolVar(&cfg.noAuth, "no-auth", false, "serve without a token (only for tests)")
	showVersion := fs.Bool("version", false, "print the version and exit")
	fs.DurationVar(&cfg.killGrace, "kill-grace", 2*time.Second, "default SIGTERM-to-SIGKILL grace on timeouts")
	fs.DurationVar(&cfg.shutdownGrace, "shutdown-grace", 5*time.Second, "how long children get to exit on shutdown")
	fs.DurationVar(&cfg.readHeaderTimeout, "read-header-timeout", defaultReadHeaderTimeout, "how long a connection may take to send a request's headers")
	fs.DurationVar(&cfg.idleTimeout, "idle-timeout", defaultIdleTimeout, "how long a keep-alive connection may wait for its next request")
	// As PID 1 the daemon's death is the sandbox's: by default its children
	// are the OOM killer's first choice.
	defaultAdj := 0
	if os.Getpid() == 1 {
		defaultAdj = 1000
	}
	fs.IntVar(&cfg.childOOMScoreAdj, "child-oom-score-adj", defaultAdj, "oom_score_adj of every child, 0 leaves it alone (default 1000 as PID 1)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if *showVersion {
		return cfg, errVersion
	}
	if cfg.childOOMScoreAdj < -1000 || cfg.childOOMScoreAdj > 1000 {
		return cfg, fmt.Errorf("--child-oom-score-adj must be in -1000..1000, got %d", cfg.childOOMScoreAdj)
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if len(listen) == 0 {
		return cfg, errors.New("at least one --listen is required")
	}
	for _, a := range listen {
		if _, _, err := parseAddr(a); err != nil {
			return cfg, err
		}
	}
	cfg.listen = listen
	cfg.token = envToken
	for _, fd := range []int{*envTokenFD, *tokenFD} {
		if fd < 0 {
			continue
		}
		token, err := readTokenFD(fd)
		if err != nil {
			return cfg, err
		}
		cfg.token = token
	}
	if *tokenFile != "" {
		data, err := os.ReadFile(*tokenFile)
		if err != nil {
			return cfg, fmt.Errorf("reading token file: %w", err)
		}
		cfg.token = strings.TrimSpace(string(data))
	}
	if cfg.token == "" && !cfg.noAuth {
		return cfg, errors.New("no token: use --token-file, --token-fd or SANDMAND_TOKEN (or --no-auth)")
	}
	if cfg.killGrace < 0 || cfg.shutdownGrace < 0 {
		return cfg, errors.New("grace durations must be >= 0")
	}
	if cfg.readHeaderTimeout <= 0 || cfg.idleTimeout <= 0 {
		return cfg, errors.New("--read-header-timeout and --idle-timeout must be > 0")
	}
	return cfg, nil
}
