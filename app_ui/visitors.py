"""What the server keeps for its visitors, and the bounds on it; no Gradio here but the names
of its routes and the shape of its request bodies.

- `Visitors` knows every live conversation, every Gradio session id an address holds, and every
  file uploaded to this app. Its `sweep` (every `Limits.sweep_s`, from the app's lifespan)
  empties conversations idle for `idle_s` and deletes uploads that nobody sent once they are
  `unsent_upload_s` old. `uploads` is the ledger: an upload is held by each conversation that
  sent it, and while no conversation sent it yet; a conversation that is cleared, expires or is
  closed lets go of every upload it sent (`release`, once), shown or not, and a file goes, once,
  when nobody holds it, its decode with it (app_ui/uploads.py `Decodes`). Each upload is its
  `Visitor`'s: Gradio stores equal contents at one path (`<upload folder>/<hash>/<name>`), so
  `uploaded` moves each file to a folder of its own with an unguessable name, and only its
  visitor may name it in a message or download it (`may_use`). Each upload is written to a
  journal of this process, outside every folder Gradio serves, so that the next process deletes
  what this one left (app_ui/journals.py, at start).
- `Guard` (app_ui/guard.py) is the ASGI middleware in front of Gradio that applies these
  bounds before Gradio reads a request: a route not allowed by name (app_ui/routes.py) answers
  404; the
  client's address is the socket's, or behind `proxy_hops` trusted proxies (a Space: 1) the
  entry the nearest proxy appended to X-Forwarded-For, counted from the right (a client writes
  the entries to its left, never that one; see docs/security.md); an upload's bytes are
  reserved under one lock before its body is read (`reserve`), so a burst cannot race the
  bound; its body is metered as it arrives (`received`: a deadline, a minimum rate, the
  server-wide space counted by bytes received) and its files are counted when Gradio answers
  (`uploaded`); a JSON body is checked for the number of files it names, whose they are
  (`may_use`), a new session past the address's `sessions_per_client` (`admit_session`: the
  address's own oldest idle session makes room), and an answer against the queue's bounds
  (app_ui/queue_rules.py); a file download (`/gradio_api/file=`) from the upload folder answers
  only the file's own visitor.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app_ui.limits import MB, Limits  # noqa: F401 (the bounds it holds; imported from here too)
from app_ui.session import Session
from app_ui.uploads import Decoded, Decodes

# A request without a session id gets a new Gradio session that no later request can reach; it
# counts among its address's sessions for this long (Gradio's state for it lasts longer).
ONE_SHOT_S = 60.0
UPLOAD_SPACE_FULL = "the server's upload space is full; try again in a few minutes"
BLOCK = 4096  # a file's disk use is rounded up to blocks, and its folder takes one more
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Visitor:
    """Who makes a request: the client's address, and the visitor cookie the Guard gave it (None:
    the request carried none, as a script's may not)."""
    client: str
    cookie: str | None = None

    def holds(self, upload: Upload) -> bool:
        """An upload made with a cookie is that cookie's; one made without, its address's."""
        return upload.cookie == self.cookie if upload.cookie else upload.client == self.client


@dataclass
class Upload:
    client: str  # the address that uploaded it
    disk: int  # bytes on disk, its folder included
    unsent: list[float] = field(default_factory=list)  # when it was uploaded, until a conversation sends it
    owners: set[int] = field(default_factory=set)  # the live conversations that sent it (ids of Sessions)
    cookie: str | None = None  # the visitor cookie of its upload request, if it carried one


@dataclass
class Reservation:
    """An upload in progress."""
    client: str
    declared: int  # its Content-Length
    received: int = 0  # bytes of its body read so far (on disk in Gradio's temporary files)


@dataclass
class Known:
    """A Gradio session id this server has seen."""
    client: str
    seen: float  # time.perf_counter() of its latest request
    conversation: bool = False  # it has held a conversation (so an empty session later means it was dropped)
    one_shot: bool = False  # a request without a session id: Gradio made it one that nobody can send again
    session: int | None = None  # id() of its Session, once a request touched it


class Visitors:
    def __init__(self, limits: Limits = Limits(), clock: Callable[[], float] = time.perf_counter,
                 journal: str | None = None, public: list[str] = ()):
        self.limits = limits
        self.clock = clock  # the clock of Turn.arrived
        self.sessions: dict[int, Session] = {}  # id -> live session
        self.known: dict[str, Known] = {}  # Gradio session id -> its address and when it was last seen
        self.uploads: dict[str, Upload] = {}  # path -> who uploaded it
        self.reserved: dict[int, Reservation] = {}  # upload in progress -> its address, declared and received bytes
        self.tokens = itertools.count()
        self.journal = journal  # this process's list of uploads (see sweep_journals)
        self.public = [os.path.join(os.path.abspath(folder), "") for folder in public]  # anyone's: the examples
        self.moved: dict[str, str] = {}  # Gradio's path -> the latest upload moved from it (see `_private`)
        self.decodes = Decodes(limits.decoded_bytes_per_client, limits.decoded_bytes_total)  # app_ui/uploads.py
        # The Gradio session ids with an answer waiting in the queue or running (app.py sets it:
        # app_ui/queue_rules.py `sessions`); called from the sweep, in the server's event loop.
        self.answering: Callable[[], set[str]] = set
        self.lock = threading.Lock()

    # --- conversations --------------------------------------------------------------------------
    def touch(self, session: Session, session_id: str | None = None) -> None:
        """`session` (Gradio's session `session_id`) made a request: it is live, and its idle time
        starts again. An empty session under an id that held a conversation was dropped by
        Gradio (its state holds the most recent `Limits.sessions`): its next message says so."""
        with self.lock:
            self.sessions[id(session)] = session
            session.last_active = self.clock()
            session.time_budget_s = self.limits.time_budget_s or None
            known = self.known.get(session_id) if session_id else None
            if known is not None:
                if known.conversation and session.is_new():
                    session.dropped_by_server = True  # told once: from here on it is a new conversation
                    known.conversation = False
                known.seen, known.session = session.last_active, id(session)

    def spoke(self, session: Session, session_id: str | None) -> None:
        """`session` holds a conversation now (a message was accepted)."""
        session.started = True
        with self.lock:
            if session_id in self.known:
                self.known[session_id].conversation = True

    def admit_session(self, client: str, session_id: str | None) -> str | None:
        """Why a request of Gradio session `session_id` (None: Gradio makes a new one) from
        `client` is refused, or None; a new id is counted as one of `client`'s sessions. At
        `sessions_per_client`, the address's own session that has been idle longest (one that
        never held a conversation first: a page loaded and left) is closed to make room; its
        next message is told so, once. Only when every one of them is answering is the new one
        refused."""
        now = self.clock()
        with self.lock:
            if session_id in self.known:
                self.known[session_id].seen = now
                return None
            mine = {key: known for key, known in self.known.items() if known.client == client}
            closed = None
            if len(mine) >= self.limits.sessions_per_client:
                idle = [key for key, known in mine.items() if not self._busy(known.session)]
                if not idle:
                    return (f"{len(mine)} conversations from your address are answering or waiting, the limit is "
                            f"{self.limits.sessions_per_client}: wait for one to end")
                oldest = min(idle, key=lambda key: (mine[key].conversation, mine[key].seen))
                closed = self.sessions.get(self.known.pop(oldest).session)
            self.known[session_id or f"one-shot-{next(self.tokens)}"] = Known(client, now, one_shot=not session_id)
        if closed is not None:
            closed.clear()
            closed.dropped_by_server = True
            self.release(closed, forget=True)
        return None

    def _busy(self, key: int | None) -> bool:
        session = self.sessions.get(key) if key is not None else None
        return session is not None and (session.running or session.pending is not None)

    def release(self, session: Session, files: set[str] | None = None, forget: bool = False) -> None:
        """`session` no longer holds `files` (None: every upload it ever sent, whether its
        conversation still shows it or not: a failed turn's, an undone one's, an answer's that
        was cleared while it ran); delete those that no other conversation holds and that nobody
        uploaded and left unsent. Idempotent: a session lets go of an upload once, and an upload
        is deleted once. `forget`: the session is no longer live either."""
        with self.lock:
            if forget:
                self.sessions.pop(id(session), None)
            paths = [path for path, upload in self.uploads.items() if id(session) in upload.owners] \
                if files is None else list(map(os.path.abspath, files))  # as `claim` holds them
            for path in paths:
                upload = self.uploads.get(path)
                if upload is not None:
                    upload.owners.discard(id(session))
                    if not upload.owners and not upload.unsent:
                        self._delete(path)

    def may_use(self, path: str, visitor: Visitor | None) -> bool:
        """`visitor` may name `path` in a message, and download it: one of its own uploads, or a
        file in a public folder (the examples); None (unknown): only the latter. Decided from the
        path as written, never from the disk."""
        path = os.path.abspath(path)
        if any(path.startswith(folder) for folder in self.public):
            return True
        with self.lock:
            upload = self.uploads.get(path)
            return upload is not None and visitor is not None and visitor.holds(upload)

    def claim(self, session: Session, files: list[str], visitor: Visitor | None) -> str | None:
        """`session` (of `visitor`) sent `files`: each of its uploads among them is now the
        session's. Returns the first file `visitor` may not use (nothing is claimed then), or None.
        `visitor` None (no Guard stamped the request: nobody to check ownership against): only
        the public files (the examples) may be used."""
        refused = next((path for path in files if not self.may_use(path, visitor)), None)
        if refused is not None:
            return refused
        with self.lock:
            for path in dict.fromkeys(os.path.abspath(path) for path in files):
                upload = self.uploads.get(path)
                if upload is not None:
                    upload.unsent.clear()
                    upload.owners.add(id(session))
        return None

    def sweep(self) -> None:
        """Empty idle conversations (freeing their images and uploads), forget idle session ids,
        and delete old uploads that no live conversation shows. A conversation with an answer
        waiting or streaming is active now: its idle time starts again when the answer ends (at
        most `sweep_s` earlier), however long the answer took. A turn accepted whose answer has
        neither waited in the queue nor run for `pending_turn_s` is dropped and its files freed
        (the page's accept step without its respond step would hold them, and the
        conversation, for ever)."""
        now = self.clock()
        answering = self.answering()
        with self.lock:
            answering = {known.session for key, known in self.known.items() if key in answering}
            stale = [s for key, s in self.sessions.items() if s.pending is not None and not (s.running or s.preparing)
                     and key not in answering and now - s.pending.arrived > self.limits.pending_turn_s]
        for session in stale:  # accepted, and its answer never asked for (or refused before it ran)
            self.release(session, session.drop_pending())
        with self.lock:
            busy = {key for key, s in self.sessions.items() if s.running or s.pending is not None}
            for key in busy:
                self.sessions[key].last_active = now
            for known in self.known.values():
                if known.session in busy:
                    known.seen = now
            idle = [s for s in self.sessions.values() if now - s.last_active > self.limits.idle_s]
            self.known = {key: known for key, known in self.known.items()
                          if now - known.seen <= (min(ONE_SHOT_S, self.limits.idle_s) if known.one_shot else self.limits.idle_s)}
        for session in idle:
            session.expire()
            self.release(session, forget=True)
        with self.lock:
            for path, upload in list(self.uploads.items()):
                upload.unsent = [t for t in upload.unsent if now - t <= self.limits.unsent_upload_s]
                if not upload.owners and not upload.unsent:
                    self._delete(path)

    # --- uploads --------------------------------------------------------------------------------
    def is_upload(self, path: str) -> bool:
        with self.lock:
            return os.path.abspath(path) in self.uploads

    def decoded(self, path: str) -> Decoded | threading.Event | None:
        """app_ui/uploads.py `Ledger.decoded`; a file that is not an upload (an example) is never kept: None."""
        return self.decodes.decoded(os.path.abspath(path)) if self.is_upload(path) else None

    def keep_decoded(self, path: str, decoded: Decoded | None) -> None:
        with self.lock:
            upload = self.uploads.get(os.path.abspath(path))
        self.decodes.keep(os.path.abspath(path), upload and upload.client, decoded)

    def reserve(self, client: str, size: int) -> tuple[int | None, str | None]:
        """(a reservation, None), or (None, why) when an upload of `size` bytes from `client`
        is refused. Against the address's own bounds the bytes count from now until `uploaded`
        or `unreserve` (so a burst cannot race them); against the server-wide bound another
        upload in progress counts the bytes it has sent (`received`), so uploads that declare
        much and send little hold no space that others could use."""
        with self.lock:
            total = sum(u.disk for u in self.uploads.values()) + sum(r.received for r in self.reserved.values())
            mine = sum(u.disk for u in self.uploads.values() if u.client == client) + \
                sum(r.declared for r in self.reserved.values() if r.client == client)
            files = sum(1 for u in self.uploads.values() if u.client == client)
            if mine + size > self.limits.upload_bytes_per_client:
                return None, (f"uploads from your address hold {mine / MB:.1f} MB and this one is {size / MB:.1f} MB; "
                              f"the limit is {self.limits.upload_bytes_per_client / MB:.0f} MB: send or clear your "
                              f"conversation, or wait {self.limits.unsent_upload_s / 60:g} minutes for unsent "
                              "uploads to be deleted")
            if files >= self.limits.upload_files_per_client:
                return None, (f"uploads from your address hold {files} files, the limit is "
                              f"{self.limits.upload_files_per_client}: send or clear your conversation, or wait "
                              f"{self.limits.unsent_upload_s / 60:g} minutes for unsent uploads to be deleted")
            if total + size > self.limits.upload_bytes_total:
                return None, UPLOAD_SPACE_FULL
            token = next(self.tokens)
            self.reserved[token] = Reservation(client, size)
            return token, None

    def received(self, token: int, size: int) -> str | None:
        """Upload `token` has `size` more bytes on disk; why it must stop (the server-wide bound
        is reached: uploads that reserved together sent more than there is room for), or None."""
        with self.lock:
            reservation = self.reserved.get(token)
            if reservation is None:
                return None
            reservation.received += size
            total = sum(u.disk for u in self.uploads.values()) + sum(r.received for r in self.reserved.values())
            return UPLOAD_SPACE_FULL if total > self.limits.upload_bytes_total else None

    def unreserve(self, token: int) -> None:
        with self.lock:
            self.reserved.pop(token, None)

    def uploaded(self, token: int, paths: list[str], cookie: str | None = None) -> tuple[list[str], str | None]:
        """The upload `token` (whose request carried `cookie`) wrote `paths`: each is moved to a
        folder of its own (`_private`) and replaces its reservation. Returns the new paths (a path
        Gradio gave twice is one file), and why they are refused (and deletes them) when they
        take `client` over its file count or one was lost on the way."""
        now = self.clock()
        with self.lock:
            client = self.reserved.pop(token, Reservation("unknown", 0)).client
            files = sum(1 for u in self.uploads.values() if u.client == client)
            private = {path: self._private(path) for path in dict.fromkeys(paths)}
            new = [path for path in private.values() if path is not None]
            refusal = None
            if len(new) < len(private):
                refusal = "an uploaded file was lost on the way (the same file uploaded twice at once?); upload again"
            elif files + len(new) > self.limits.upload_files_per_client:
                refusal = (f"{len(new)} files would take your address over {self.limits.upload_files_per_client} "
                           "uploaded files; send fewer")
            for path in new:
                self.uploads[path] = Upload(client, 0 if refusal else disk_use(path), [now], cookie=cookie)
                if refusal:
                    self._delete(path)
            if refusal:
                return [], refusal
            self._journal(new)
        return [private[path] for path in paths], None

    def _private(self, path: str) -> str | None:
        """Move Gradio's `<folder>/<hash>/<name>` (equal contents share it) to `<folder>/<random>/<name>`,
        a path nobody can guess and nobody else's upload shares. When the file is gone because another
        upload of the same bytes moved it a moment ago, a copy of that one; None when that is gone too."""
        path = os.path.abspath(path)
        folder, name = os.path.split(path)
        private = os.path.join(os.path.dirname(folder), secrets.token_hex(16), name)
        try:
            os.makedirs(os.path.dirname(private))
            try:
                os.rename(path, private)
            except FileNotFoundError:
                shutil.copyfile(self.moved[path], private)  # KeyError or FileNotFoundError: lost
        except (OSError, KeyError):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(private))
            return None
        with contextlib.suppress(OSError):
            os.rmdir(folder)
        self.moved = {**dict(list(self.moved.items())[-63:]), path: private}
        return private

    def _delete(self, path: str) -> None:
        """Remove an upload, its decode and its folder if that is now empty (Gradio keeps one folder a file)."""
        self.uploads.pop(path, None)
        self.decodes.forget(path)
        with contextlib.suppress(OSError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))

    def _journal(self, paths: list[str]) -> None:
        if self.journal and paths:
            with contextlib.suppress(OSError), open(self.journal, "a") as file:
                file.writelines(path + "\n" for path in paths)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """For FastAPI's `lifespan`: sweep every `sweep_s` while the server runs; at its end, delete
        every upload and the journal."""
        import asyncio

        async def sweep_forever():
            while True:
                await asyncio.sleep(self.limits.sweep_s)
                try:
                    self.sweep()
                except Exception:  # the next sweep tries again
                    logger.exception("sweeping visitors failed")

        task = asyncio.create_task(sweep_forever())
        try:
            yield
        finally:
            task.cancel()
            with self.lock:  # moved out of Gradio's paths, they are not in what Gradio deletes at close
                for path in list(self.uploads):
                    self._delete(path)
            if self.journal:
                with contextlib.suppress(OSError):
                    os.remove(self.journal)


def disk_use(path: str) -> int:
    """What `path` takes on disk: its blocks and its folder's."""
    try:
        return max(BLOCK, math.ceil(os.stat(path).st_blocks * 512 / BLOCK) * BLOCK) + BLOCK
    except OSError:
        return 2 * BLOCK
