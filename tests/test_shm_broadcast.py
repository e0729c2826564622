"""The shared-memory message queue that carries rank 0's steps to its workers (chapter 09):
every reader gets every message, in order, across the ring's wrap-around and across
messages larger than a slot; a full ring waits and a dead reader is an error, not a hang;
no file is left behind."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nanovllm.engine.shm_broadcast import MessageQueue

REPO = Path(__file__).resolve().parents[1]


def messages(seed: int, count: int, max_bytes: int) -> list:
    """Objects of random sizes: empty, smaller than a slot, and spanning several slots."""
    rng = random.Random(seed)
    out: list = [None, b"", ("step", 1)]
    for i in range(count):
        size = rng.choice([0, 1, 7, rng.randrange(max_bytes)])
        out.append({"i": i, "data": rng.randbytes(size), "array": np.arange(size % 50)})
    return out


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def test_readers_get_every_message_in_order_across_wraparound_and_big_messages():
    queue = MessageQueue.create(num_readers=2, slots=3, slot_bytes=64)
    sent = messages(seed=1, count=200, max_bytes=1000)  # up to 16 slots per message
    readers = [MessageQueue.attach(queue.handle(), r) for r in range(2)]
    received: list[list] = [[], []]

    def read(r: int) -> None:
        for _ in sent:
            received[r].append(readers[r].get())

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for obj in sent:
        queue.put(obj)
    for t in threads:
        t.join(60)
    for r in range(2):
        assert len(received[r]) == len(sent)
        assert all(same(a, b) for a, b in zip(sent, received[r], strict=True))
    for q in [*readers, queue]:
        q.close()


READER = """
import hashlib, pickle, sys
from nanovllm.engine.shm_broadcast import MessageQueue
queue = MessageQueue.attach(tuple(__import__("json").loads(sys.argv[1])), int(sys.argv[2]))
digest = hashlib.sha256()
while (obj := queue.get()) != "stop":
    digest.update(pickle.dumps(obj))
print(digest.hexdigest())
"""


def test_readers_in_other_processes():
    """Two processes map the file and read everything; the name is gone once they have."""
    import hashlib
    import pickle

    queue = MessageQueue.create(num_readers=2, slots=4, slot_bytes=256)
    procs = [subprocess.Popen([sys.executable, "-c", READER, json.dumps(queue.handle()), str(r)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO) for r in range(2)]
    queue.wait_until_attached(check=lambda: None)
    assert not os.path.exists(queue.path)  # deleted: the mappings keep the memory
    sent = [m for m in messages(seed=2, count=300, max_bytes=3000) if m is not None]
    digest = hashlib.sha256()
    for obj in sent:
        queue.put(obj)
        digest.update(pickle.dumps(obj))
    queue.put("stop")
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert out.strip() == digest.hexdigest()
    queue.close()


def test_a_full_ring_waits_for_the_slowest_reader_and_check_can_end_the_wait():
    queue = MessageQueue.create(num_readers=2, slots=2, slot_bytes=64)
    fast, slow = (MessageQueue.attach(queue.handle(), r) for r in range(2))
    queue.put(1)
    queue.put(2)
    assert fast.get() == 1 and fast.get() == 2  # the slow reader has read nothing yet

    class ReaderGone(RuntimeError):
        pass

    calls = []

    def check() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise ReaderGone

    start = time.monotonic()
    with pytest.raises(ReaderGone):
        queue.put(3, check=check)  # slot 1 still holds message 1 for the slow reader
    assert 0.25 < time.monotonic() - start < 5
    assert slow.get() == 1  # nothing was overwritten
    queue.put(3)  # now there is room
    assert [slow.get(), slow.get(), fast.get()] == [2, 3, 3]
    for q in (fast, slow, queue):
        q.close()


def test_no_file_outlives_the_queue():
    queue = MessageQueue.create(num_readers=1)
    assert os.path.exists(queue.path) and queue.path.startswith(("/dev/shm", "/tmp"))
    other = MessageQueue.create(num_readers=1)
    assert other.path != queue.path  # two engines on one host never share a ring
    for q in (queue, other):
        q.close()
        assert not os.path.exists(q.path)
    assert not glob.glob(queue.path + "*")
