"""What the server keeps for its visitors, and the bounds on it; no Gradio here but the names
of its routes.

- `Visitors` knows every live conversation and every file uploaded to this app. Its `sweep`
  (every `Limits.sweep_s`, from the app's lifespan) empties conversations idle for
  `idle_s` and deletes uploads that no live conversation shows once they are
  `unsent_upload_s` old; a conversation that is cleared or expires deletes its own uploads.
- `Guard` is an ASGI middleware in front of Gradio: it answers 404 for deep links (Gradio
  would write a visitor's whole page state, messages and upload paths included, to a file that
  anyone knowing the session id could fetch), refuses uploads over the per-client or total
  bounds and request bodies over `request_bytes` before they are read, and stamps each
  request's arrival time (`scope["state"]["arrived"]`, time.perf_counter()) for Stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app_ui.session import Session

MB = 1024 * 1024
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    idle_s: float = 30 * 60  # a conversation without a request for this long is emptied
    unsent_upload_s: float = 10 * 60  # an upload no conversation shows is deleted after this
    upload_bytes_per_client: int = 200 * MB  # on disk at once, per client address
    upload_bytes_total: int = 2048 * MB  # on disk at once, all clients
    request_bytes: int = 4 * MB  # any request body but an upload's
    sweep_s: float = 10.0
    # Gradio keeps its own state for this many sessions, the most recently active (the page's
    # components as that visitor last saw them; size per session: docs/app.md); an older one is dropped.
    sessions: int = 1000


@dataclass
class Upload:
    client: str
    size: int
    created: float  # time.perf_counter() of its latest upload (Gradio stores equal contents at one path)


class Visitors:
    def __init__(self, limits: Limits = Limits(), clock: Callable[[], float] = time.perf_counter):
        self.limits = limits
        self.clock = clock  # the clock of Turn.arrived
        self.sessions: dict[int, Session] = {}  # id -> live session
        self.uploads: dict[str, Upload] = {}  # path -> who uploaded it
        self.lock = threading.Lock()

    # --- conversations --------------------------------------------------------------------------
    def touch(self, session: Session) -> None:
        """`session` made a request: it is live, and its idle time starts again."""
        with self.lock:
            self.sessions[id(session)] = session
            session.last_active = self.clock()

    def release(self, files: set[str], since: float, session: Session | None = None) -> None:
        """Delete the uploads among `files` (those of a conversation just cleared, whose last
        message arrived at `since`) that no other live conversation shows and nobody uploaded
        again after `since` (equal contents share a path); `session`: also drop it from the live
        ones."""
        with self.lock:
            if session is not None:
                self.sessions.pop(id(session), None)
            shown = set().union(*(other.files() for other in self.sessions.values()))
            for path in files - shown:
                if path in self.uploads and self.uploads[path].created <= since:
                    self._delete(path)

    def sweep(self) -> None:
        """Empty idle conversations (freeing their images and uploads) and delete old uploads
        that no live conversation shows."""
        now = self.clock()
        with self.lock:
            idle = [s for s in self.sessions.values() if now - s.last_active > self.limits.idle_s and not s.running]
        for session in idle:
            files, since = session.files(), session.last_message()
            session.expire()
            self.release(files, since, session)
        with self.lock:
            shown = set().union(*(session.files() for session in self.sessions.values()))
            for path, upload in list(self.uploads.items()):
                if path not in shown and now - upload.created > self.limits.unsent_upload_s:
                    self._delete(path)

    # --- uploads --------------------------------------------------------------------------------
    def admit(self, client: str, size: int) -> str | None:
        """Why an upload of `size` bytes from `client` is refused, or None."""
        with self.lock:
            total = sum(upload.size for upload in self.uploads.values())
            mine = sum(upload.size for upload in self.uploads.values() if upload.client == client)
        if mine + size > self.limits.upload_bytes_per_client:
            return (f"uploads from your address hold {mine / MB:.0f} MB of the "
                    f"{self.limits.upload_bytes_per_client / MB:.0f} MB allowed; send or clear your conversation, "
                    f"or wait {self.limits.unsent_upload_s / 60:g} minutes for unsent uploads to be deleted")
        if total + size > self.limits.upload_bytes_total:
            return "the server's upload space is full; try again in a few minutes"
        return None

    def uploaded(self, client: str, paths: list[str], size: int) -> None:
        """`client` uploaded `paths`, `size` bytes in all (the request's length: Gradio may still be
        moving the files into place)."""
        now = self.clock()
        with self.lock:
            for path in paths:
                self.uploads[path] = Upload(client, size // max(1, len(paths)), now)

    def _delete(self, path: str) -> None:
        """Remove an upload and its folder if that is now empty (Gradio keeps one folder a file)."""
        self.uploads.pop(path, None)
        with contextlib.suppress(OSError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """For FastAPI's `lifespan`: sweep every `sweep_s` while the server runs."""
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


class Guard:
    """ASGI middleware: see the module docstring. `forwarded`: take the client's address from
    X-Forwarded-For (behind a proxy that sets it, as on Hugging Face Spaces)."""

    def __init__(self, app, visitors: Visitors, forwarded: bool = False):
        self.app = app
        self.visitors = visitors
        self.forwarded = forwarded

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        path, headers = scope["path"].rstrip("/"), dict(scope.get("headers") or [])
        if path.endswith("/deep_link") or "deep_link=" in scope.get("query_string", b"").decode("latin-1"):
            return await _refuse(send, 404, "deep links are off on this server: each visitor's conversation is private")
        if b"transfer-encoding" in headers:  # a body of unknown length: not taken
            return await _refuse(send, 411, "a request body needs a Content-Length")
        length = headers.get(b"content-length", b"0")
        length = int(length) if length.isdigit() else 0
        if scope["method"] == "POST" and path.endswith("/upload"):
            client = self._client(scope, headers)
            refusal = self.visitors.admit(client, length)
            if refusal:
                return await _refuse(send, 429, refusal)
            return await self.app(scope, receive, _recording_upload(send, self.visitors, client, length))
        if length > self.visitors.limits.request_bytes:
            return await _refuse(send, 413, f"the request is {length / MB:.1f} MB; the limit is "
                                            f"{self.visitors.limits.request_bytes / MB:.0f} MB (files go through "
                                            "the upload route)")
        return await self.app(scope, receive, send)

    def _client(self, scope, headers: dict) -> str:
        forwarded = headers.get(b"x-forwarded-for", b"").decode("latin-1").split(",")[0].strip()
        if self.forwarded and forwarded:
            return forwarded
        return (scope.get("client") or ("unknown",))[0]


def _recording_upload(send, visitors: Visitors, client: str, size: int):
    """`send`, noting the paths a successful upload response lists as `client`'s (`size` bytes)."""
    status, body = [0], []

    async def recording(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body" and status[0] == 200:
            body.append(message.get("body", b""))
            if not message.get("more_body"):
                with contextlib.suppress(ValueError):
                    paths = json.loads(b"".join(body))
                    visitors.uploaded(client, [p for p in paths if isinstance(p, str)], size)
        await send(message)

    return recording


async def _refuse(send, status: int, text: str) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
