"""An independent decoder of vLLM's KV cache events, for the simulator's tests.

It uses libzmq (pyzmq) and msgpack, not the simulator's Go code. Every
message it receives is printed as one JSON line describing each frame and,
for the payload, every decoded value with its Python type, so that the Go
test can check field order and types exactly.

Modes (argv[1]):
  sub ENDPOINT TOPIC COUNT TIMEOUT_S
      connect a SUB socket to ENDPOINT, subscribe to TOPIC, print
      {"ready": true} once subscribed, then print COUNT messages.
  bind-sub ENDPOINT TOPIC COUNT TIMEOUT_S
      bind the SUB socket on ENDPOINT instead (the publisher dials), print
      {"ready": true, "endpoint": …} with the bound endpoint, then COUNT
      messages.
  replay ENDPOINT START TIMEOUT_S
      ask the ROUTER socket at ENDPOINT from a DEALER socket for the batches
      from sequence START, print every answer until the end marker.
Lines go to stdout; a timeout exits with status 3.
"""

import json
import sys

import msgpack
import zmq


def describe(value):
    """A JSON-able tree of value with the Python type name of every node."""
    if isinstance(value, list):
        return {"t": "list", "v": [describe(v) for v in value]}
    if isinstance(value, dict):
        return {"t": "dict", "k": [k for k in value], "v": [describe(v) for v in value.values()]}
    if isinstance(value, bytes):
        return {"t": "bytes", "v": value.hex()}
    if value is None:
        return {"t": "NoneType"}
    return {"t": type(value).__name__, "v": value}


def message(frames):
    out = {"frames": len(frames)}
    if len(frames) == 3:
        topic, seq, payload = frames
        out["topic"] = topic.decode("utf-8", "replace")
        out["seq_len"] = len(seq)
        out["seq"] = int.from_bytes(seq, "big", signed=True)
        if payload:
            out["payload"] = describe(msgpack.unpackb(payload, raw=False, strict_map_key=False))
    return out


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def subscribe(bind, endpoint, topic, count, timeout_s):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
    if bind:
        sock.bind(endpoint)
        emit({"ready": True, "endpoint": sock.getsockopt_string(zmq.LAST_ENDPOINT)})
    else:
        sock.connect(endpoint)
        emit({"ready": True})
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    for _ in range(count):
        if not poller.poll(timeout_s * 1000):
            emit({"timeout": True})
            sys.exit(3)
        emit(message(sock.recv_multipart()))


def replay(endpoint, start, timeout_s):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    # vLLM's request: an empty delimiter, then the start sequence as 8
    # big-endian bytes; the ROUTER sees [identity, b"", start].
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if not poller.poll(timeout_s * 1000):
            emit({"timeout": True})
            sys.exit(3)
        frames = sock.recv_multipart()
        # The DEALER receives [b"", seq, payload]; report the delimiter.
        out = message([b"replay"] + frames[1:]) if len(frames) == 3 else {"frames": len(frames)}
        out["delimiter"] = frames[0].hex() if frames else None
        out["frames"] = len(frames)
        emit(out)
        if len(frames) == 3 and frames[1] == (-1).to_bytes(8, "big", signed=True):
            return


def main():
    mode = sys.argv[1]
    if mode in ("sub", "bind-sub"):
        subscribe(mode == "bind-sub", sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    elif mode == "replay":
        replay(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit("unknown mode " + mode)


if __name__ == "__main__":
    main()
