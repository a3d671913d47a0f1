"""Untrusted images are decoded only in jailed child processes (issue 57): the server never runs a
Pillow decoder on bytes a visitor sent.

    jail = ImageJail(from_environ(Decoding))               # the app's main(): one per process
    image = jail.load(path, **served.image_fit(), client=address, cancelled=stopped, deadline=t)

`ImageJail` keeps a pool of `Decoding.slots()` children (`VLM_DECODE_SLOTS`), each a
`python -m engine.image_child` (that module's docstring gives the protocol and the limits it sets
on itself: address space `VLM_DECODE_MEMORY_MB`, CPU seconds `VLM_DECODE_SECONDS`). A child
opens the file (the formats allow-list and the header checks of engine/images.py run there),
asks this process for the size the model takes (`fit_size` needs the processor and the family,
which stay here: the child gets two numbers), decodes, reduces and hands back 8-bit RGB pixels
at that size, or a refusal naming the file and the limit. This process kills a child that is
past its wall-clock deadline (`VLM_DECODE_SECONDS`, or the answer's time budget when that comes
first), whose caller has stopped (`cancelled`), or that misbehaves; a killed or retired child
is replaced by a new one when the next image comes. A decoder bomb so costs its child, never
the server.

Why subprocess with a worker module, not multiprocessing: a child is a fresh interpreter that
imports engine/images.py alone (PIL and numpy: 0.1 GB of address space, no torch, no model, no
copy of the server's heap or threads as a fork would give), sets its own limits before reading
a byte, and speaks a protocol of JSON headers and raw pixels, so nothing it sends is unpickled
here (multiprocessing's pipes unpickle what a child sends, and a child whose decoder was
subverted must not run code in the server).

Bounds on waiting: at most `slots` images decode at once, and at most `decodes_per_client` of
one address (`VLM_DECODES_PER_CLIENT`): a visitor's bombs wait for each other, not for another
visitor's photo. A waiting caller holds no pixels and stops waiting when it is cancelled or past
its deadline. A decode past `long_decode_s` (`VLM_LONG_DECODE_S`) leaves its slot for the long
lane (`LONG_SLOTS`), or, that taken while another address waits, ends refused: several
addresses' bombs cost a waiting photo about `long_decode_s` each, not `decode_seconds`.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from PIL import Image

from engine.image_child import OUT_OF_MEMORY, receive, send
from engine.images import (MAX_DECODED_BYTES, MAX_FILE_BYTES, MAX_PIXELS, ImageError, fit_size, load_image,
                           resample_of, shape_refused)
from engine.settings import setting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_S = 0.05  # how often a wait looks at its caller's stop
START_S = 60.0  # a new child has this long to import Pillow and say it is ready (outside any image's limit)
CPU_GRACE_S = 2  # the CPU limit's seconds past the wall deadline (Child.start)
LONG_SLOTS = 1  # decodes past `long_decode_s` going on at once, outside the slots


def default_decode_slots() -> int:
    """Two at most, and one core left for the server's event loop (a 2-core Space decodes one at a time)."""
    return max(1, min(2, (os.cpu_count() or 2) - 1))


@dataclass(frozen=True)
class Decoding:
    """The app's bounds on decoding (docs/security.md), read by engine/settings.py `from_environ`."""

    decode_slots: int | None = setting(None, "images decoded at once, all requests together (default 2, or 1 on "
                                       "a 2-core machine)", low=0, env="VLM_DECODE_SLOTS")
    decode_memory_mb: int = setting(1024, "address space of one decoding process in MB; a file that needs more is "
                                    "refused", low=256, env="VLM_DECODE_MEMORY_MB")
    decode_seconds: float = setting(20.0, "the longest one image may take to decode (wall clock, and CPU time)",
                                    low=1, env="VLM_DECODE_SECONDS")
    decodes_per_client: int = setting(1, "images one client address has decoded at once", low=1,
                                      env="VLM_DECODES_PER_CLIENT")
    long_decode_s: float = setting(1.0, "a decode past this leaves its slot to others: one such at a time, the "
                                   "next refused while another address waits", low=0.1, env="VLM_LONG_DECODE_S")

    def slots(self) -> int:
        return default_decode_slots() if self.decode_slots is None else max(1, self.decode_slots)


class Stopped(ImageError):
    """The caller stopped (Stop, New chat) before its image was decoded."""


class OutOfTime(ImageError):
    """The caller's time budget ran out before its image was decoded: the caller's limit, not the file's
    (another request may decode it)."""


class _Busy(Exception):
    """A decode past `long_decode_s`, the long lane taken and another address waiting: it ends."""


@dataclass
class Lane:
    long: bool = False  # where a decode holds its turn: one of the slots, or the long lane


class _Ended(Exception):
    """The child's pipe ended: the child is gone."""


def never() -> bool:
    return False


@dataclass
class Child:
    """One decoding process and its pipes (unbuffered: select sees every byte it sent)."""

    process: subprocess.Popen
    retire: bool = False  # it asked to be replaced (its CPU lifetime), or it was killed
    ready: bool = False  # it said so: its imports and limits are done

    @classmethod
    def start(cls, decoding: Decoding) -> Child:
        # The CPU limit a little past the wall deadline: a decode on a free core meets the deadline first,
        # where the refusal can still read the child's peak address space (a child held at its memory
        # limit can spend its seconds there, and should be refused for its memory); it is the backstop.
        limits = {"memory_mb": decoding.decode_memory_mb, "cpu_s": math.ceil(decoding.decode_seconds) + CPU_GRACE_S,
                  "max_pixels": MAX_PIXELS}
        threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        return cls(subprocess.Popen([sys.executable, "-m", "engine.image_child", json.dumps(limits)], cwd=ROOT,
                                    env={**os.environ, **threads}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, bufsize=0))

    def kill(self) -> None:
        self.retire = True
        if self.process.poll() is None:  # a retiring child that has not ended yet is ended too
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()

    def wait_ready(self, cancelled: Callable[[], bool]) -> None:
        """Until the child has said it is ready (its first message), so that its start-up is not
        counted in an image's time limit."""
        if not self.ready:
            self.receive(time.monotonic() + START_S, cancelled)
            self.ready = True

    def used_memory_mb(self) -> float:
        """The most address space the child has held (VmPeak), in MB; 0 where /proc cannot say."""
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                peak = next(line for line in status if line.startswith("VmPeak:"))
            return int(peak.split()[1]) / 1024
        except (OSError, StopIteration, ValueError):
            return 0.0

    def send(self, message: dict, payload: bytes = b"") -> None:
        try:
            send(self.process.stdin, message, payload)
        except (BrokenPipeError, OSError):
            raise _Ended from None

    def receive(self, until: float, cancelled: Callable[[], bool]) -> dict:
        message = receive(lambda size: self.read(size, until, cancelled))
        if message is None:
            raise _Ended
        return message

    def read(self, size: int, until: float, cancelled: Callable[[], bool]) -> bytes:
        """`size` bytes from the child; TimeoutError past `until` (time.monotonic()), Stopped when
        `cancelled()`, _Ended when the child is gone first."""
        data, fd = bytearray(size), self.process.stdout.fileno()
        view, got = memoryview(data), 0
        while got < size:
            if cancelled():
                raise Stopped
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not select.select([fd], [], [], min(POLL_S, left))[0]:
                continue
            count = os.readv(fd, [view[got:]])
            if not count:
                raise _Ended
            got += count
        return data  # bytes-like: Image.frombytes and json read it without a copy


@dataclass
class ImageJail:
    """The pool of decoding children (the module docstring); `peak`: the most images ever decoded at once."""

    decoding: Decoding = field(default_factory=Decoding)
    idle: list[Child] = field(default_factory=list)
    busy: int = 0  # decodes in the slots
    long_busy: int = 0  # decodes past long_decode_s, in the long lane
    slot_waiters: int = 0  # callers waiting for a slot (not for their own address's bound)
    busy_by_client: dict[str | None, int] = field(default_factory=dict)
    peak: int = 0
    turns: threading.Condition = field(default_factory=threading.Condition)

    def warm(self) -> None:
        """Start every child now (each imports Pillow while the app starts), not at the first image."""
        with self.turns:
            while len(self.idle) < self.decoding.slots():
                self.idle.append(Child.start(self.decoding))

    def close(self) -> None:
        with self.turns:
            idle, self.idle = self.idle, []
        for child in idle:
            child.kill()

    def load(self, source, name: str | None = None, max_bytes: int = MAX_FILE_BYTES, max_pixels: int = MAX_PIXELS,
             fit=None, max_decoded_bytes: int = MAX_DECODED_BYTES, family=None, client: str | None = None,
             cancelled: Callable[[], bool] = never, deadline: float | None = None) -> Image.Image:
        """engine/images.py `load_image`'s answer for `source` (a path or bytes a visitor sent),
        decoded in a child; a PIL image (the server's own) is fitted here. `client`: whose turn it
        is (its address); `cancelled()`: the caller stopped (Stopped); `deadline`
        (time.monotonic()): the caller's time budget ends then. ImageError names the file and the
        limit hit; the image's `info["decoded_by"]` is the child's process id."""
        if isinstance(source, Image.Image):
            return load_image(source, fit=fit, family=family)
        name = name or (os.path.basename(source) if isinstance(source, (str, os.PathLike)) else "image")
        data = bytes(source) if isinstance(source, (bytes, bytearray)) else None
        job = {"name": name, "path": None if data is not None else os.path.abspath(source),
               "data_bytes": len(data or b""), "max_bytes": max_bytes, "max_pixels": max_pixels,
               "max_decoded_bytes": max_decoded_bytes, "fit": fit is not None, "resample": resample_of(fit)}
        if data is not None and len(data) > max_bytes:  # not sent to a child at all
            raise ImageError(f"{name}: {len(data) / 1e6:.1f} MB is over the upload limit of {max_bytes / 1e6:.0f} MB")
        with self._turn(client, name, cancelled, deadline) as lane:
            if cancelled():  # stopped while it waited: no child is asked
                raise Stopped(f"{name}: not decoded: the answer was stopped")
            return self._decode(job, data or b"", lambda width, height: fit_size(width, height, fit, family),
                                cancelled, deadline, lane)

    def _decode(self, job: dict, data: bytes, target_for, cancelled, deadline: float | None,
                lane: Lane) -> Image.Image:
        """One job in a child (a new one if the idle one has gone meanwhile); the child goes back
        to the pool unless it failed, was stopped, retires, or left the long lane to others."""
        name, limit_s = job["name"], self.decoding.decode_seconds
        for attempt in (1, 2):
            child, until = self._child(), None
            try:
                child.wait_ready(cancelled)
                until = min(time.monotonic() + limit_s, math.inf if deadline is None else deadline)
                long_at = time.monotonic() + self.decoding.long_decode_s

                def watched() -> bool:  # the caller's stop, and the slot left past long_decode_s
                    return cancelled() or (time.monotonic() >= long_at and self._leave_slot(lane))

                image = self._exchange(child, job, data, target_for, until, watched)
                break
            except _Busy:
                child.kill()
                raise ImageError(f"{name}: decoding takes over {self.decoding.long_decode_s:g} s, and the server is "
                                 "decoding another such image now; send it again in a moment") from None
            except _Ended:
                child.kill()
                if attempt == 1 and not job.pop("sent", False):
                    continue  # it had ended while idle: a new one takes the job
                raise ImageError(_death(name, child.process.returncode, self.decoding)) from None
            except TimeoutError:
                full = child.used_memory_mb() >= 0.9 * self.decoding.decode_memory_mb  # allocating at its limit
                child.kill()
                if until is None:
                    raise ImageError(f"{name}: not decoded: the image decoder did not start within {START_S:g} s")
                if deadline is not None and until >= deadline:
                    raise OutOfTime(f"{name}: not decoded: the answer's time budget ran out first") from None
                raise ImageError(_late(name, full, self.decoding)) from None
            except Stopped:
                child.kill()
                raise Stopped(f"{name}: not decoded: the answer was stopped") from None
            except ImageError:  # the child's refusal: it serves the next image
                raise
            except BaseException:  # the caller's own errors (a processor's): the child's state is unknown
                child.kill()
                raise
            finally:
                self._put_back(child)
        return image

    def _exchange(self, child: Child, job: dict, data: bytes, target_for, until: float, cancelled) -> Image.Image:
        if cancelled():
            raise Stopped
        child.send(job, data)
        job["sent"] = True
        reply = child.receive(until, cancelled)
        while "header" in reply:
            child.send(self._target(job, reply["header"], target_for))
            reply = child.receive(until, cancelled)
        child.retire = bool(reply.get("retire"))
        if "refused" in reply:
            raise ImageError(str(reply["refused"])[:500])
        width, height = reply["size"]
        if not (isinstance(width, int) and isinstance(height, int) and 0 < width * height <= job["max_pixels"]):
            child.retire = True
            raise ImageError(f"{job['name']}: the decoder answered a size of {width!r}x{height!r}")
        image = Image.frombytes("RGB", (width, height), child.read(width * height * 3, until, cancelled))
        image.info["decoded_by"] = reply.get("pid")
        return image

    @staticmethod
    def _target(job: dict, header, target_for) -> dict:
        """The size the model takes the image at, from the upright size the child read in its
        header ({"target": None}: as it is); {"refused": why} where the model's processor would
        refuse that shape (Qwen-VL's over 200:1): the child refuses the file, never decoding it."""
        if not job["fit"]:
            return {"target": None}
        width, height = (int(side) for side in header)
        try:
            return {"target": target_for(width, height)}
        except Exception as error:  # e.g. a 40,000,000x1 PNG for Qwen-VL
            return {"refused": str(shape_refused(job["name"], width, height, error))}

    def _put_back(self, child: Child) -> None:
        """An idle child for the next image, or, retiring, ended and reaped."""
        if child.retire:
            child.kill()
            return
        with self.turns:
            self.idle.append(child)

    def _child(self) -> Child:
        with self.turns:
            if self.idle:
                return self.idle.pop()
        return Child.start(self.decoding)

    def _leave_slot(self, lane: Lane) -> bool:
        """A decode past long_decode_s: into the long lane if that is free (its slot to the next
        caller); _Busy if not, while another caller waits for a slot; else it keeps its slot."""
        with self.turns:
            if lane.long:
                return False
            if self.long_busy < LONG_SLOTS:
                lane.long, self.long_busy, self.busy = True, self.long_busy + 1, self.busy - 1
                self.turns.notify_all()
            elif self.slot_waiters:
                raise _Busy
        return False

    @contextmanager
    def _turn(self, client: str | None, name: str, cancelled: Callable[[], bool], deadline: float | None):
        """Wait for a slot, and for the client's own bound; Stopped or ImageError when the caller
        stops or its deadline passes first. Yields the decode's Lane."""
        per_client, for_slot = self.decoding.decodes_per_client, False
        with self.turns:
            try:
                while self.busy >= self.decoding.slots() or self.busy_by_client.get(client, 0) >= per_client:
                    own = self.busy_by_client.get(client, 0) >= per_client  # waiting for its own address's decodes
                    if for_slot == own:
                        for_slot, self.slot_waiters = not own, self.slot_waiters + (-1 if own else 1)
                    if cancelled():
                        raise Stopped(f"{name}: not decoded: the answer was stopped")
                    if deadline is not None and time.monotonic() >= deadline:
                        raise OutOfTime(f"{name}: not decoded: the answer's time budget ran out while it waited "
                                        "for the image decoders")
                    self.turns.wait(POLL_S)
            finally:
                self.slot_waiters -= for_slot
            self.busy += 1
            self.busy_by_client[client] = self.busy_by_client.get(client, 0) + 1
            self.peak = max(self.peak, self.busy + self.long_busy)
        lane = Lane()
        try:
            yield lane
        finally:
            with self.turns:
                if lane.long:
                    self.long_busy -= 1
                else:
                    self.busy -= 1
                self.busy_by_client[client] -= 1
                if not self.busy_by_client[client]:
                    del self.busy_by_client[client]
                self.turns.notify_all()


def _late(name: str, full: bool, decoding: Decoding) -> str:
    """The refusal for a child past its wall-clock limit: out of memory (a process at its address-space
    limit retries every allocation, slowly, rather than fail), or out of time."""
    if full:
        return (f"{name}: needed more than {decoding.decode_memory_mb:,} MB to decode (the server's limit for one "
                "image); send a smaller image")
    return f"{name}: decoding took more than {decoding.decode_seconds:g} s (the server's limit for one image)"


def _death(name: str, returncode: int | None, decoding: Decoding) -> str:
    """The refusal for a child that ended without answering: its limits say why (a child out of
    memory may also end so, its allocator or interpreter failing before Python can refuse)."""
    if returncode == OUT_OF_MEMORY:
        return _late(name, True, decoding)
    if returncode == -signal.SIGXCPU:
        return (f"{name}: decoding took more than {math.ceil(decoding.decode_seconds) + CPU_GRACE_S} s of CPU time (the server's "
                "limit for one image)")
    how = f"signal {-returncode}" if returncode is not None and returncode < 0 else f"exit status {returncode}"
    return (f"{name}: the decoder ended on it ({how}; the server's limits for one image: "
            f"{decoding.decode_memory_mb:,} MB, {decoding.decode_seconds:g} s); send a smaller or another image")
