package testkit

import (
	"bytes"
	"strings"
	"sync"
)

// LockedBuffer is a bytes.Buffer guarded by a mutex: an io.Writer that a
// command, a logger or a child process's output copier writes to on its
// own goroutine while the test reads what it wrote so far. The zero value
// is empty and ready to use; it must not be copied once written to.
type LockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p; it never fails.
func (b *LockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *LockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Lines returns the complete lines written so far, without their "\n";
// a last line not ended yet is left out, and nil means none.
func (b *LockedBuffer) Lines() []string {
	s := b.String()
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return strings.Split(s[:i], "\n")
	}
	return nil
}
