package bench

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTicks is the kernel's USER_HZ, the unit of utime and stime in
// /proc/<pid>/stat: AT_CLKTCK from the auxiliary vector, else 100.
var clockTicks = func() int64 {
	auxv, err := os.ReadFile("/proc/self/auxv")
	if err == nil {
		const atClkTck = 17
		for i := 0; i+16 <= len(auxv); i += 16 {
			k := binary.NativeEndian.Uint64(auxv[i:])
			v := binary.NativeEndian.Uint64(auxv[i+8:])
			if k == atClkTck && v > 0 {
				return int64(v)
			}
		}
	}
	return 100
}()

// parseStatCPU reads utime + stime from the text of /proc/<pid>/stat. The
// command name (field 2) is in parentheses and may hold spaces and
// parentheses, so fields are counted from the last ')'.
func parseStatCPU(stat []byte) (time.Duration, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("/proc stat: no command name")
	}
	fields := bytes.Fields(stat[i+1:])
	// fields[0] is field 3 (state); utime is field 14, stime field 15.
	if len(fields) < 13 {
		return 0, fmt.Errorf("/proc stat: %d fields after the command name, want at least 13", len(fields))
	}
	utime, err1 := strconv.ParseInt(string(fields[11]), 10, 64)
	stime, err2 := strconv.ParseInt(string(fields[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, errors.New("/proc stat: utime or stime is not an integer")
	}
	return time.Duration((utime + stime) * int64(time.Second) / clockTicks), nil
}

// parseStatusRSS reads the "VmRSS:  1234 kB" line of /proc/<pid>/status.
func parseStatusRSS(b []byte) (int64, error) {
	for _, line := range strings.Split(string(b), "\n") {
		rest, ok := strings.CutPrefix(line, "VmRSS:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			break
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, err
		}
		return kb << 10, nil
	}
	return 0, errors.New("bench: no VmRSS in /proc status")
}
