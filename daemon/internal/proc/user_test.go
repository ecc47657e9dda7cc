package proc

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"

	"sandman/daemon/internal/apierr"
)

const testPasswd = `# a comment
root:x:0:0:root:/root:/bin/sh
agent:x:4321:4322:Agent:/home/agent:/bin/sh
nohome:x:4400:4400:::/bin/sh
broken:x:notanumber:1::/:/bin/sh
short:x
`

const testGroup = `root:x:0:
agentg:x:4322:
extra:x:4500:other, agent
other:x:4501:agentx
dup:x:4322:agent
`

func etcDir(t *testing.T, passwd, group string) string {
	t.Helper()
	dir := t.TempDir()
	if passwd != "" {
		os.WriteFile(filepath.Join(dir, "passwd"), []byte(passwd), 0o644)
	}
	if group != "" {
		os.WriteFile(filepath.Join(dir, "group"), []byte(group), 0o644)
	}
	return dir
}

func codeOf(err error) string {
	var ae *apierr.Error
	if errors.As(err, &ae) {
		return ae.Code
	}
	return ""
}

func TestLookupUser(t *testing.T) {
	etc := etcDir(t, testPasswd, testGroup)
	cases := []struct {
		spec string
		want identity
	}{
		{"agent", identity{uid: 4321, gid: 4322, groups: []uint32{4322, 4500}, home: "/home/agent", name: "agent"}},
		{"4321", identity{uid: 4321, gid: 4322, groups: []uint32{4322, 4500}, home: "/home/agent", name: "agent"}},
		{"root", identity{uid: 0, gid: 0, groups: []uint32{0}, home: "/root", name: "root"}},
		{"5555", identity{uid: 5555, gid: 0, groups: []uint32{0}, home: "/"}},
		{"5555:77", identity{uid: 5555, gid: 77, groups: []uint32{77}, home: "/"}},
		{"agent:4600", identity{uid: 4321, gid: 4600, groups: []uint32{4600}, home: "/home/agent", name: "agent"}},
		{"agent:extra", identity{uid: 4321, gid: 4500, groups: []uint32{4500}, home: "/home/agent", name: "agent"}},
		{"nohome", identity{uid: 4400, gid: 4400, groups: []uint32{4400}, home: "/", name: "nohome"}},
	}
	for _, c := range cases {
		got, err := lookupUser(etc, c.spec)
		if err != nil {
			t.Errorf("%s: %v", c.spec, err)
			continue
		}
		c.want.spec = c.spec
		if !reflect.DeepEqual(*got, c.want) {
			t.Errorf("%s: got %+v, want %+v", c.spec, *got, c.want)
		}
	}
	for _, spec := range []string{"nobody-here", "agent:nogroup", "broken", "short"} {
		if _, err := lookupUser(etc, spec); codeOf(err) != "unknown_user" {
			t.Errorf("%s: got %v, want unknown_user", spec, err)
		}
	}
	// No passwd at all: a uid still works, a name does not.
	bare := etcDir(t, "", "")
	if id, err := lookupUser(bare, "1000"); err != nil || id.uid != 1000 || id.gid != 0 || id.home != "/" {
		t.Errorf("uid without passwd: %+v %v", id, err)
	}
	if _, err := lookupUser(bare, "agent"); codeOf(err) != "unknown_user" {
		t.Errorf("name without passwd: %v", err)
	}
	// A fifo in the place of passwd is refused without being opened for long.
	fifo := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(fifo, "passwd"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := lookupUser(fifo, "agent"); codeOf(err) != "unknown_user" {
		t.Errorf("fifo passwd: %v", err)
	}
}

func TestCheckUserSpec(t *testing.T) {
	for _, ok := range []string{"agent", "0", "4294967294", "a:b", "1:2", "www-data", "agent:0"} {
		if err := CheckUserSpec(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"", ":", ":grp", "agent:", "a:b:c", "4294967295", "99999999999", "1:4294967295", "a\x00b", "a\nb"} {
		if err := CheckUserSpec(bad); codeOf(err) != "invalid_request" {
			t.Errorf("%q: got %v, want invalid_request", bad, err)
		}
	}
}

// A daemon that may not switch users runs commands as itself only.
func TestCredentialWithoutPrivilege(t *testing.T) {
	r := &Runner{canSwitch: false}
	self := &identity{uid: uint32(os.Getuid()), gid: uint32(os.Getgid()), spec: "me"}
	if cred, err := r.credential(self); cred != nil || err != nil {
		t.Errorf("own identity: %v %v", cred, err)
	}
	other := &identity{uid: uint32(os.Getuid()) + 1, gid: 0, spec: "other"}
	if _, err := r.credential(other); codeOf(err) != "permission_denied" {
		t.Errorf("other identity: %v", err)
	}
	r.canSwitch = true
	cred, err := r.credential(&identity{uid: 7, gid: 8, groups: []uint32{8, 9}})
	if err != nil || cred.Uid != 7 || cred.Gid != 8 || !reflect.DeepEqual(cred.Groups, []uint32{8, 9}) {
		t.Errorf("privileged: %+v %v", cred, err)
	}
}
