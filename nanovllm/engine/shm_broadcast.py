"""Rank 0's step messages to the workers of one host, through shared memory (chapter 09).

Chapter 09 §7.1 measures it against a gloo broadcast; vLLM's ``MessageQueue`` is the same idea.
The pickled message fills one or more chunks of a ring of ``slots`` slots; each chunk's header
``(number, length, more)`` has its ``number`` written last, so a reader that sees its next
number sees a complete chunk. Each reader publishes how many chunks it has read, and the one
writer reuses a slot only once every reader is past it. The file in ``/dev/shm`` loses its name
as soon as every worker has mapped it, so nothing is left behind.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial

_CACHE_LINE = 64  # each counter sits on a line of its own: readers don't share a line
_CHUNK_HEADER = struct.Struct("<qqq")  # chunk number, payload length, more chunks follow
_COUNTER = struct.Struct("<q")
SPIN_SECONDS = 0.01  # poll with sched_yield this long, then sleep between polls
IDLE_SECONDS = 1.0  # waiting longer than this (an idle server): poll once a millisecond
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (taking a lock implies one): the payload's bytes are visible
    before its chunk number on any CPU, not only on x86's ordered stores."""
    with _fence_lock:
        pass


def _wait(ready: Callable[[], bool], check: Callable[[], None] | None = None) -> None:
    """Return once ``ready()``; spin briefly, then sleep, calling ``check`` (which may raise)
    every 0.1 s while waiting."""
    start = checked = time.monotonic()
    while not ready():
        now = time.monotonic()
        if check is not None and now - checked > 0.1:
            check()
            checked = now
        waited = now - start
        if waited < SPIN_SECONDS:
            os.sched_yield()
        else:
            time.sleep(1e-4 if waited < IDLE_SECONDS else 1e-3)


class MessageQueue:
    """One writer (``create``) broadcasting picklable objects to ``num_readers`` processes
    (``attach``), in order, through a ring of shared-memory slots."""

    def __init__(self, path: str, num_readers: int, slots: int, slot_bytes: int,
                 reader: int | None) -> None:
        self.path, self.num_readers, self.slots, self.slot_bytes = (
            path, num_readers, slots, slot_bytes)
        self.reader = reader  # None: this is the writer
        # Layout: per reader a read counter, then per reader an "attached" flag, then slots.
        self._slots_at = 2 * num_readers * _CACHE_LINE
        self._slot_stride = _CHUNK_HEADER.size + slot_bytes
        size = self._slots_at + slots * self._slot_stride
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if reader is None else 0), 0o600)
        try:
            if reader is None:
                os.ftruncate(fd, size)  # zero-filled: no chunk written, nothing read
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = memoryview(self._map)
        self._count = 0  # chunks this side has written (writer) or read (reader)
        if reader is not None:
            _COUNTER.pack_into(self._buf, self._attached_at(reader), 1)

    @classmethod
    def create(cls, num_readers: int, slots: int = 4, slot_bytes: int = 1 << 20) -> MessageQueue:
        """The writer's side: a new shared-memory file under a unique name."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="nanovllm-mq-", dir=folder)
        os.close(fd)
        os.unlink(path)  # mkstemp only picked the unique name; __init__ creates it exclusively
        return cls(path, num_readers, slots, slot_bytes, reader=None)

    def handle(self) -> tuple[str, int, int, int]:
        """What a reader passes to ``attach`` (picklable)."""
        return self.path, self.num_readers, self.slots, self.slot_bytes

    @classmethod
    def attach(cls, handle: tuple[str, int, int, int], reader: int) -> MessageQueue:
        """Reader number ``reader`` (0 .. num_readers-1) maps the writer's file."""
        path, num_readers, slots, slot_bytes = handle
        return cls(path, num_readers, slots, slot_bytes, reader=reader)

    def _read_at(self, reader: int) -> int:
        return reader * _CACHE_LINE

    def _attached_at(self, reader: int) -> int:
        return (self.num_readers + reader) * _CACHE_LINE

    def _slot_at(self, number: int) -> int:
        return self._slots_at + (number - 1) % self.slots * self._slot_stride

    def _counter(self, offset: int) -> int:
        return _COUNTER.unpack_from(self._buf, offset)[0]

    def _all_read(self, number: int) -> bool:
        return all(self._counter(self._read_at(r)) >= number for r in range(self.num_readers))

    def _is_published(self, at: int, number: int) -> bool:
        return self._counter(at) == number

    def wait_until_attached(self, check: Callable[[], None] | None = None) -> None:
        """The writer waits for every reader to map the file, then deletes its name: the
        mappings keep the memory, and no file outlives the processes however they end."""
        _wait(lambda: all(self._counter(self._attached_at(r)) for r in range(self.num_readers)),
              check)
        self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def put(self, obj: object, check: Callable[[], None] | None = None) -> None:
        """Send ``obj`` to every reader. Waits while the ring is full; ``check`` is called
        meanwhile every 0.1 s and may raise (e.g. when a reader's process has died)."""
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        for start in range(0, max(len(data), 1), self.slot_bytes):
            chunk = data[start : start + self.slot_bytes]
            number = self._count + 1
            # The slot's previous chunk, number - slots: has every reader read it?
            _wait(partial(self._all_read, number - self.slots), check)
            at = self._slot_at(number)
            payload = at + _CHUNK_HEADER.size
            self._buf[payload : payload + len(chunk)] = chunk
            more = start + self.slot_bytes < len(data)
            _COUNTER.pack_into(self._buf, at + 8, len(chunk))
            _COUNTER.pack_into(self._buf, at + 16, int(more))
            _fence()
            _COUNTER.pack_into(self._buf, at, number)  # last: publishes the chunk
            self._count = number

    def get(self) -> object:
        """The next object the writer sent (waits for it, however long)."""
        parts = []
        while True:
            number = self._count + 1
            at = self._slot_at(number)
            _wait(partial(self._is_published, at, number))
            _fence()
            _, length, more = _CHUNK_HEADER.unpack_from(self._buf, at)
            payload = at + _CHUNK_HEADER.size
            parts.append(bytes(self._buf[payload : payload + length]))
            _fence()
            _COUNTER.pack_into(self._buf, self._read_at(self.reader), number)  # slot is free
            self._count = number
            if not more:
                return pickle.loads(b"".join(parts))

    def close(self) -> None:
        """Unmap the memory (the writer also deletes the name, if still there)."""
        if self.reader is None:
            self.unlink()
        self._buf.release()
        self._map.close()
