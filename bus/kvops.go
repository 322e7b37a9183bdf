package bus

import "encoding/binary"

// ReadKVOps is EachKVOp for a caller that applies batch after batch
// without allocating (behaviour.md R-PLACE-4): the header of data, a
// batch CheckKVBatch accepts, is written to *h (the caller's, reused;
// its EngineID a view of data), then fn is called, in order, with every
// op, its keys decoded into buf (grown when an op needs more room, and
// returned for the next batch); fn must keep neither h's id nor keys.
// Once buf has grown it allocates nothing. It returns the batch's error,
// if any, before any call, and *h is then unchanged.
func ReadKVOps(data []byte, h *KVHeader, buf []uint64, fn func(op KVOp, rank int, medium KVMedium, keys []uint64)) ([]uint64, error) {
	hdr, body, err := checkKVBatch(data)
	if err != nil {
		return buf, err
	}
	*h = hdr
	for len(body) > 0 {
		op, rank, medium := KVOp(body[0]), int(body[1]), KVMedium(body[2])
		n := int(binary.LittleEndian.Uint16(body[3:]))
		raw := body[kvOpHeader : kvOpHeader+8*n]
		body = body[kvOpHeader+8*n:]
		if cap(buf) < n {
			buf = make([]uint64, n, max(n, 256))
		}
		keys := buf[:n]
		decodeHashes(keys, raw)
		fn(op, rank, medium, keys)
	}
	return buf, nil
}
