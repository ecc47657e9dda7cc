//go:build sandman_seccomp

// This file is not built here: hack/gvisor/build copies it into its copy of gVisor's
// runsc/boot/filter/config (the build tag keeps it out of this module's builds), where
// it adds SandmanPrograms to that package.

package config

import (
	"fmt"
	"os"
	"reflect"

	"golang.org/x/sys/unix"

	"gvisor.dev/gvisor/pkg/seccomp"
	"gvisor.dev/gvisor/pkg/seccomp/precompiledseccomp"
)

// SandmanPrograms precompiles the sentry's seccomp programs for those of upstream's
// options (optionsToPrecompile, 576 of them) that keep accepts, one at a time, the
// way PrecompiledPrograms does for all of them.
func SandmanPrograms(keep func(Options) bool) ([]precompiledseccomp.Program, error) {
	all, err := optionsToPrecompile()
	if err != nil {
		return nil, err
	}
	var programs []precompiledseccomp.Program
	for _, opt := range all {
		if !keep(opt) {
			continue
		}
		var varNames []string
		for varName := range opt.Vars() {
			varNames = append(varNames, varName)
		}
		program, err := precompiledseccomp.Precompile(opt.ConfigKey(), varNames, func(vars precompiledseccomp.Values) *seccomp.Program {
			rules, denyRules := rules(opt, vars)
			if err := selfKill(rules, vars.GetUint64(selfPIDVarName)); err != nil {
				panic(fmt.Sprintf("options %v: %v", opt.ConfigKey(), err))
			}
			return &seccomp.Program{
				RuleSets: []seccomp.RuleSet{
					{Rules: denyRules.Copy()},
					{Rules: rules.Copy(), Action: seccomp.Allow},
				},
				Options: SeccompOptions(opt),
			}
		})
		if err != nil {
			return nil, fmt.Errorf("cannot precompile seccomp program for options %v: %w", opt.ConfigKey(), err)
		}
		programs = append(programs, program)
	}
	return programs, nil
}

// selfKill makes the platforms' rt_tgsigqueueinfo rule take the sentry's pid from the
// self_pid variable, as tgkill's does. systrap and ptrace allow
// rt_tgsigqueueinfo(getpid(), tid, SIGKILL) (sighandling.KillItself, when a stub
// process was SIGKILLed) with os.Getpid() of the process that builds the filter:
// precompiled as it is, that is the generator's pid, and the sentry's own call would
// be refused. Anything else than that one rule is an error: look again.
func selfKill(rules seccomp.SyscallRules, pid uint64) error {
	want := seccomp.PerArg{seccomp.EqualTo(os.Getpid()), seccomp.AnyValue{}, seccomp.EqualTo(unix.SIGKILL)}
	got := rules.Get(unix.SYS_RT_TGSIGQUEUEINFO)
	if !reflect.DeepEqual(got, want) {
		return fmt.Errorf("rt_tgsigqueueinfo rule is %v, want %v", got, want)
	}
	rules.Remove(unix.SYS_RT_TGSIGQUEUEINFO)
	rules.Set(unix.SYS_RT_TGSIGQUEUEINFO, seccomp.PerArg{seccomp.EqualTo(pid), seccomp.AnyValue{}, seccomp.EqualTo(unix.SIGKILL)})
	return nil
}
