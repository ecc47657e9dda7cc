package archive

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// MountPoints returns the mount points below root, relative to it, as this
// process's mount table (/proc/self/mountinfo) names them; root itself is
// not one. A sandbox's tree holds the runtime's mounts (/proc, /sys, /dev,
// /etc/hosts, the daemon's /.sandman, volumes): none of them is its files.
func MountPoints(root string) (map[string]bool, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	prefix := strings.TrimSuffix(abs, "/") + "/"
	found := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// id parent major:minor root mount-point options ...
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		point := unescapeMount(fields[4])
		if rel, ok := strings.CutPrefix(point, prefix); ok && rel != "" {
			found[filepath.Clean(rel)] = true
		}
	}
	return found, sc.Err()
}

// unescapeMount undoes the kernel's octal escapes (\040 for a space...).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
