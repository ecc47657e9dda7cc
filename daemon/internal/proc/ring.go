package proc

// ring retains the last max bytes written to a stream, with absolute
// offsets: total counts every byte ever written, so a reader can resume
// where it stopped and see how much was dropped.
type ring struct {
	buf   []byte // grows up to max, then wraps
	pos   int    // once full: index of the oldest byte (next to overwrite)
	max   int
	total int64
}

func (r *ring) write(p []byte) {
	r.total += int64(len(p))
	if r.max <= 0 {
		return
	}
	if len(p) >= r.max {
		r.buf = append(r.buf[:0], p[len(p)-r.max:]...)
		r.pos = 0
		return
	}
	if len(r.buf) < r.max {
		n := min(r.max-len(r.buf), len(p))
		r.buf = append(r.buf, p[:n]...)
		p = p[n:]
	}
	for len(p) > 0 {
		n := copy(r.buf[r.pos:], p)
		p = p[n:]
		r.pos = (r.pos + n) % r.max
	}
}

// read returns the retained bytes from absolute offset from (clamped to what
// is retained) and the offset they actually start at.
func (r *ring) read(from int64) ([]byte, int64) {
	first := r.total - int64(len(r.buf))
	if from < first {
		from = first
	}
	if from > r.total {
		from = r.total
	}
	skip := int(from - first)
	n := len(r.buf) - skip
	out := make([]byte, 0, n)
	if len(r.buf) < r.max {
		return append(out, r.buf[skip:]...), from
	}
	start := (r.pos + skip) % len(r.buf)
	if start+n <= len(r.buf) {
		return append(out, r.buf[start:start+n]...), from
	}
	out = append(out, r.buf[start:]...)
	return append(out, r.buf[:n-(len(r.buf)-start)]...), from
}
