"""A stand-in for vLLM's ZMQ event publisher (same wire: PUB `(topic, seq, payload)`, a ROUTER replay
socket answering each buffered batch from the asked seq, then seq -1), for the routing tests that
run without vLLM. tests/vllm_plugin drive vLLM's own publisher."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque

import zmq

from kvatlas.routing.events import EventBatch
from kvatlas.routing.vllm_events import encode_batch

END = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakePublisher:
    def __init__(self, port: int, replay_port: int | None, buffer_steps: int = 100, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.replay = None
        if replay_port is not None:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer = deque(maxlen=buffer_steps)
        self.topic, self.seq = topic, 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch, *, drop: bool = False, payload: bytes | None = None) -> int:
        """Publish (or, with drop, only buffer: a batch the subscriber misses) the next batch."""
        payload = encode_batch(batch) if payload is None else payload
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
            if not drop:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.replay is None or not self.replay.poll(20):
                time.sleep(0.02) if self.replay is None else None
                continue
            client, _, start = self.replay.recv_multipart()
            start = int.from_bytes(start, "big")
            with self._lock:
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        self.replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                self.replay.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.ctx.term()


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
