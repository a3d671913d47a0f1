"""A visitor's uploads as the app opens them: decoded in the jail's children (engine/image_jail.py),
once each. The pixels at the model's size (or the file's refusal) are kept for the upload in the
ledger (app_ui/visitors.py `Visitors`, which holds a `Decodes`) until the upload is deleted, so the
page's check when a file is attached, the send, and an answer whose images the Guard decoded
before its turn (app_ui/prepare_lane.py, `decode_uploads`) share one decode. No Gradio here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from PIL import Image

from engine import images
from engine.image_jail import POLL_S, ImageJail, OutOfTime, Stopped, never
from engine.images import ImageError

if TYPE_CHECKING:
    from app_ui.served import Served


@dataclass(frozen=True)
class Decoded:
    """An upload as the jail answered it: its pixels at the model's size, or the refusal naming the file."""

    image: Image.Image | None = None
    refusal: str | None = None

    def nbytes(self) -> int:
        return self.image.width * self.image.height * len(self.image.getbands()) if self.image is not None else 0

    def result(self) -> Image.Image:
        if self.image is None:
            raise ImageError(self.refusal)
        return self.image


class Ledger(Protocol):
    """Where an upload's Decoded is kept (app_ui/visitors.py `Visitors`)."""

    def decoded(self, path: str) -> Decoded | threading.Event | None:
        """The upload's Decoded; or an Event set when another caller's decode of it ends; or None:
        the caller decodes it, and then calls `keep_decoded` (whatever happens)."""

    def keep_decoded(self, path: str, decoded: Decoded | None) -> None:
        """`decoded` kept on the upload's entry (None: nothing to keep); callers waiting go on."""


def open_upload(path: str, jail: ImageJail, ledger: Ledger | None = None, **options) -> Image.Image:
    """A visitor's file decoded in `jail`'s children (engine/image_jail.py `ImageJail.load`, its
    options): the one way the app opens an upload. With `ledger`, once per upload: the pixels, or
    the file's refusal, are kept there; a caller stopped or out of time keeps nothing (the next
    caller decodes it), and a caller that comes while another decodes it waits for that one."""
    if ledger is None:
        return jail.load(path, **options)
    name, cancelled, deadline = options.get("name") or os.path.basename(path), options.get("cancelled", never), \
        options.get("deadline")
    while isinstance(running := ledger.decoded(path), threading.Event):
        _wait_for(running, name, cancelled, deadline)
    if running is not None:
        return running.result()
    decoded = None
    try:
        decoded = Decoded(jail.load(path, **options))
    except (Stopped, OutOfTime):
        raise
    except ImageError as error:
        decoded = Decoded(refusal=str(error))
    finally:
        ledger.keep_decoded(path, decoded)
    return decoded.result()


def decode_uploads(engine: Served, ledger: Ledger, paths: list[str], client: str, cancelled: Callable[[], bool],
                   budget_s: float | None) -> tuple[float, str | None]:
    """An answer's uploads decoded before it joins the line (app_ui/prepare_lane.py; the Guard calls
    it on a thread), each kept in `ledger`, within the time budget `budget_s`: (the seconds it took,
    the refusal when the budget ran out first, else None). It stops at the first file refused
    (kept: the answer names it) or when `cancelled()`."""
    started, deadline = time.perf_counter(), time.monotonic() + budget_s if budget_s else None
    for path in paths:
        try:
            open_upload(path, jail=engine.jail, ledger=ledger, name=os.path.basename(path), **engine.image_fit(),
                        client=client, cancelled=cancelled, deadline=deadline)
        except OutOfTime as error:
            return time.perf_counter() - started, str(error)
        except ImageError:
            break
    return time.perf_counter() - started, None


def return_freed_memory() -> None:
    """The heap pages an answer freed (its images' pixels, the processor's arrays) back to the
    system: glibc keeps them in the answering thread's arena otherwise (engine/images.py)."""
    images._return_freed_memory()


def _wait_for(decode: threading.Event, name: str, cancelled: Callable[[], bool], deadline: float | None) -> None:
    """Until another caller's decode of `name` ends; Stopped or OutOfTime as the jail's wait for a turn."""
    while not decode.wait(POLL_S):
        if cancelled():
            raise Stopped(f"{name}: not decoded: the answer was stopped")
        if deadline is not None and time.monotonic() >= deadline:
            raise OutOfTime(f"{name}: not decoded: the answer's time budget ran out while it waited for the image "
                            "decoders")


class Decodes:
    """The uploads' Decoded and the decodes in progress, by path, for the ledger: within
    `per_client` / `total` bytes of pixels, the least recently used forgotten first (decoded again
    if they are sent)."""

    def __init__(self, per_client: int, total: int):
        self.per_client, self.total = per_client, total
        self.kept: dict[str, tuple[str, Decoded]] = {}  # path -> (its client, its decode), least recently used first
        self.running: dict[str, threading.Event] = {}  # path -> set when its decode ends
        self.lock = threading.Lock()

    def decoded(self, path: str) -> Decoded | threading.Event | None:
        """As `Ledger.decoded`, for an upload the ledger holds."""
        with self.lock:
            if path in self.kept:
                self.kept[path] = self.kept.pop(path)  # used: the last to go
                return self.kept[path][1]
            if path in self.running:
                return self.running[path]
            self.running[path] = threading.Event()
            return None

    def keep(self, path: str, client: str | None, decoded: Decoded | None) -> None:
        """The decode of `path` ended: `decoded` kept for `client` (None: the upload is gone, nothing kept)."""
        with self.lock:
            ended = self.running.pop(path, None)
            if decoded is not None and client is not None:
                self.kept[path] = (client, decoded)
                self._bound(client)
        if ended is not None:
            ended.set()

    def forget(self, *paths: str) -> None:
        """The uploads are deleted (or their turn refused: their pixels serve nothing; decoded again if
        sent again): their pixels go, and callers waiting for their decodes go on."""
        with self.lock:
            for path in paths:
                self.kept.pop(path, None)
            ended = [self.running.pop(path) for path in paths if path in self.running]
        for event in ended:
            event.set()

    def _bound(self, client: str) -> None:
        mine = sum(decoded.nbytes() for owner, decoded in self.kept.values() if owner == client)
        total = sum(decoded.nbytes() for _, decoded in self.kept.values())
        for path, (owner, decoded) in list(self.kept.items()):
            if (owner == client and mine > self.per_client) or total > self.total:
                del self.kept[path]
                mine, total = mine - (decoded.nbytes() if owner == client else 0), total - decoded.nbytes()
