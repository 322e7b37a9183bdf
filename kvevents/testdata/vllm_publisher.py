#!/usr/bin/python3
"""An independent publisher of vLLM's KV cache events, for the agent's tests.

It speaks vLLM's ZeroMQ protocol with libzmq (Debian's python3-zmq) and
msgpack (python3-msgpack), not with the agent's own code: a PUB-compatible
XPUB socket sending [topic, sequence as 8 bytes big-endian, msgpack payload],
the payload [ts, [events...], data_parallel_rank] (or, as the newest vLLM
encodes it, a map), the events as tagged arrays (older vLLM) or maps with a
"type" member (newer); and vLLM's replay socket: a ROUTER that answers
[identity, "", start sequence] with [identity, "", sequence, payload] for
every buffered batch from start on, then [identity, "", -1, ""].

The test drives it with one JSON command per line on stdin and reads one JSON
answer per line on stdout.
"""

import collections
import json
import sys
import time

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)

STORED_REQUIRED = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
STORED_OPTIONAL = ["lora_name", "extra_keys", "group_idx"]
REMOVED_REQUIRED = ["block_hashes", "medium"]
REMOVED_OPTIONAL = ["group_idx"]


def value(v):
    """JSON to what msgpack should send: {"b": hex} is bytes, {"repeat": v,
    "n": n} is n times v, lists are arrays."""
    if isinstance(v, dict) and set(v) == {"b"}:
        return bytes.fromhex(v["b"])
    if isinstance(v, dict) and set(v) == {"repeat", "n"}:
        return [value(v["repeat"])] * v["n"]
    if isinstance(v, list):
        return [value(x) for x in v]
    return v


def encode_event(ev, fmt):
    kind = ev["type"]
    if kind == "BlockStored":
        required, optional = STORED_REQUIRED, STORED_OPTIONAL
    elif kind == "BlockRemoved":
        required, optional = REMOVED_REQUIRED, REMOVED_OPTIONAL
    else:
        required, optional = [], [k for k in ev if k != "type"]
    if fmt == "array":
        out = [kind] + [value(ev.get(k)) for k in required]
        tail = [value(ev.get(k)) for k in optional]
        while tail and tail[-1] is None:  # msgspec's omit_defaults
            tail.pop()
        return out + tail
    out = {"type": kind}
    for k in required:
        out[k] = value(ev.get(k))
    for k in optional:
        if ev.get(k) is not None:
            out[k] = value(ev[k])
    return out


def encode_batch(events, fmt, batch, rank):
    evs = [encode_event(e, fmt) for e in events]
    if batch == "map":
        b = {"ts": time.time(), "events": evs}
        if rank is not None:
            b["data_parallel_rank"] = rank
        return msgpack.packb(b, use_bin_type=True)
    return msgpack.packb([time.time(), evs, rank], use_bin_type=True)


def bind_again(sock, endpoint):
    """Binds, trying again for a while: libzmq frees a closed socket's port
    on its I/O thread, a moment after close returns."""
    deadline = time.time() + 5
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.time() > deadline:
                raise
            time.sleep(0.01)


class Publisher:
    def __init__(self):
        self.ctx = zmq.Context.instance()
        self.pub = None
        self.replay = None
        self.seq = 0
        self.buffer = collections.deque(maxlen=10000)
        self.subs = 0
        self.replay_mode = "normal"
        self.replays = 0

    def open(self, endpoint, bind, replay, topic):
        self.endpoint, self.bind, self.replay_ep = endpoint, bind, replay
        self.topic = topic.encode()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        if bind:
            bind_again(self.pub, endpoint)
            self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            self.pub.connect(endpoint)
        if replay:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            bind_again(self.replay, replay)
            self.replay_ep = self.replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        return {"endpoint": self.endpoint, "replay": self.replay_ep}

    def close(self):
        for s in (self.pub, self.replay):
            if s is not None:
                s.close(linger=0)
        self.pub = self.replay = None

    def poll(self, timeout_ms):
        """Services subscriptions and replay requests for up to timeout_ms."""
        poller = zmq.Poller()
        poller.register(self.pub, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        for sock, _ in poller.poll(timeout_ms):
            if sock is self.pub:
                msg = self.pub.recv()
                if msg[:1] == b"\x01":
                    self.subs += 1
            elif sock is self.replay:
                self.service_replay()

    def service_replay(self):
        frames = self.replay.recv_multipart()
        self.replays += 1
        if len(frames) != 3 or self.replay_mode == "silent":
            return
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for seq, buf in self.buffer:
            if seq >= start:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), buf))
        self.replay.send_multipart((client, b"", END_SEQ, b""))

    def send(self, payload, skip):
        seq = self.seq
        self.seq += 1
        if not skip:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        return seq


def main():
    p = Publisher()
    poller = zmq.Poller()
    poller.register(sys.stdin, zmq.POLLIN)
    while True:
        if p.pub is not None:
            p.poll(0)
        if not poller.poll(5):
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        out = {"ok": True}
        if op == "open":
            out.update(p.open(cmd["endpoint"], cmd.get("bind", True), cmd.get("replay"), cmd.get("topic", "")))
        elif op == "wait_subscribed":
            deadline = time.time() + cmd.get("timeout", 10)
            while p.subs < cmd["count"] and time.time() < deadline:
                p.poll(5)
            out["ok"] = p.subs >= cmd["count"]
            out["subs"] = p.subs
        elif op == "send":
            payload = encode_batch(cmd["events"], cmd.get("format", "array"), cmd.get("batch", "array"), cmd.get("rank", 0))
            out["seq"] = p.send(payload, cmd.get("skip", False))
        elif op == "send_payload":
            payload = bytes.fromhex(cmd["hex"]) * cmd.get("times", 1)
            out["seq"] = p.send(payload, cmd.get("skip", False))
        elif op == "raw":
            p.pub.send_multipart([bytes.fromhex(f) for f in cmd["frames"]])
        elif op == "forget":
            p.buffer.clear()
        elif op == "replay_mode":
            p.replay_mode = cmd["mode"]
        elif op == "restart":
            p.close()
            p.seq = 0
            p.buffer.clear()
            out.update(p.open(cmd.get("endpoint", p.endpoint), p.bind, cmd.get("replay", p.replay_ep), p.topic.decode()))
            p.subs = 0
        elif op == "stats":
            out.update({"seq": p.seq, "subs": p.subs, "replays": p.replays})
        elif op == "quit":
            print(json.dumps(out), flush=True)
            break
        else:
            out = {"ok": False, "error": "unknown op " + op}
        print(json.dumps(out), flush=True)
    p.close()


if __name__ == "__main__":
    main()
