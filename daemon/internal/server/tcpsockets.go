package server

import (
	"bufio"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// tcpStates names the states of /proc/net/tcp (include/net/tcp_states.h).
var tcpStates = map[string]string{
	"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
	"05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
	"09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}

// tcpInodes reads /proc/net/tcp and tcp6 (this network namespace's): the
// inode of every socket a process holds, to "state local-address".
func tcpInodes() (map[string]string, error) {
	found := map[string]string{}
	for _, name := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		f, err := os.Open(name)
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(f)
		sc.Scan() // the header
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) < 10 || fields[9] == "0" {
				continue // no inode: no process holds it (TIME_WAIT)
			}
			state := tcpStates[fields[3]]
			if state == "" {
				state = fields[3]
			}
			found[fields[9]] = state + " " + hexAddr(fields[1])
		}
		f.Close()
		if err := sc.Err(); err != nil {
			return nil, err
		}
	}
	return found, nil
}

// hexAddr turns /proc/net/tcp's "0100007F:1F90" into "127.0.0.1:8080" (an
// IPv6 address is left in hex, but for its port).
func hexAddr(s string) string {
	host, port, ok := strings.Cut(s, ":")
	p, err := strconv.ParseUint(port, 16, 16)
	if !ok || err != nil {
		return s
	}
	if len(host) == 8 {
		if v, err := strconv.ParseUint(host, 16, 32); err == nil {
			// Little-endian on every machine we run on.
			return strconv.Itoa(int(v&0xff)) + "." + strconv.Itoa(int(v>>8&0xff)) + "." +
				strconv.Itoa(int(v>>16&0xff)) + "." + strconv.Itoa(int(v>>24)) + ":" + strconv.Itoa(int(p))
		}
	}
	if strings.Trim(host, "0") == "" {
		return "[::]:" + strconv.Itoa(int(p))
	}
	return "[" + host + "]:" + strconv.Itoa(int(p))
}

// descendants returns the pids whose chain of parents reaches root (root
// excluded). In a sandbox the daemon is PID 1: that is every process.
func descendants(root int) []int {
	entries, _ := os.ReadDir("/proc")
	parent := map[int]int{}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// "pid (comm) state ppid ...": comm may hold spaces and parentheses.
		i := strings.LastIndexByte(string(data), ')')
		if i < 0 {
			continue
		}
		fields := strings.Fields(string(data[i+1:]))
		if len(fields) < 2 {
			continue
		}
		if ppid, err := strconv.Atoi(fields[1]); err == nil {
			parent[pid] = ppid
		}
	}
	var out []int
	for pid := range parent {
		for p, hops := parent[pid], 0; hops < 4096; p, hops = parent[p], hops+1 {
			if p == root {
				out = append(out, pid)
				break
			}
			if p <= 1 {
				break
			}
		}
	}
	sort.Ints(out)
	return out
}

// tcpHolders lists, for each process the daemon (pid self) started, directly
// or not, the TCP sockets it holds: "LISTEN 0.0.0.0:8080". The daemon's own
// are left out.
func tcpHolders(self int) (map[int][]string, error) {
	inodes, err := tcpInodes()
	if err != nil {
		return nil, err
	}
	holders := map[int][]string{}
	if len(inodes) == 0 {
		return holders, nil
	}
	for _, pid := range descendants(self) {
		dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
		fds, err := os.ReadDir(dir)
		if err != nil {
			continue // gone, or not ours to read
		}
		seen := map[string]bool{}
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join(dir, fd.Name()))
			if err != nil || !strings.HasPrefix(link, "socket:[") {
				continue
			}
			inode := strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")
			if what, ok := inodes[inode]; ok && !seen[inode] {
				seen[inode] = true
				holders[pid] = append(holders[pid], what)
			}
		}
	}
	return holders, nil
}

func sortedPids(m map[int][]string) []int {
	out := make([]int, 0, len(m))
	for pid := range m {
		out = append(out, pid)
	}
	sort.Ints(out)
	return out
}

func itoa(n int) string { return strconv.Itoa(n) }

// comm is a process's name, or "?" once it is gone.
func comm(pid int) string {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "comm"))
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(data))
}
