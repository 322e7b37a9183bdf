package schemas

import (
	"bufio"
	"io"
)

// MaxSSELine bounds one SSE line assembled by ReadSSELine: 64 MiB.
const MaxSSELine = 64 << 20

// ReadSSELine returns the next line of an SSE stream read through br, with
// its "\n" (the last line of a stream may lack it). A line that fits br's
// buffer is returned without copying and is valid until the next read; a
// longer one is assembled in *long, which is reused from call to call. A
// line over MaxSSELine fails with io.ErrShortBuffer. Other errors are br's.
func ReadSSELine(br *bufio.Reader, long *[]byte) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if err != bufio.ErrBufferFull {
		return line, err
	}
	*long = append((*long)[:0], line...)
	for {
		line, err = br.ReadSlice('\n')
		*long = append(*long, line...)
		if err != bufio.ErrBufferFull {
			return *long, err
		}
		if len(*long) > MaxSSELine {
			return nil, io.ErrShortBuffer
		}
	}
}
