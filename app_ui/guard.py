"""`Guard`: the ASGI middleware in front of Gradio (see app_ui/visitors.py for what it bounds).

Cheap checks come first, before Gradio reads, hashes or copies anything: the route, by name
(app_ui/routes.py: any other answers 404; this app has no WebSocket route, so none is opened),
the path, the headers, the Content-Length; then, for a JSON body (bounded by
`Limits.request_bytes`, `request_deadline_s` and the bodies being read at once: app_ui/bodies.py), one
parse in a worker thread that counts the files the request names as it goes (keys as JSON
reads them, escaped or not; it stops past the limit) and checks that each is the visitor's own
upload (or an example), without touching the disk. An answer that names uploads is held out of
the answer lane while they are decoded (app_ui/prepare_lane.py), so that no decode runs in the
answer slot. A refusal is one line naming the problem:
text for an upload, and for a JSON request the 422 shape Gradio's clients show as a validation
message.

A visitor is known by a cookie (`COOKIE`) that the page and `/config` hand out (gradio_client
keeps those of its `/config`), else by its address alone; a file in the upload folder is
downloaded only by the visitor who uploaded it, and anything else there answers as a file that
does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
import time

import anyio

from app_ui import prepare_lane, queue_rules, routes
from app_ui.bodies import MeteredBody, Reading, read_body, recording_upload, refuse, refuse_json, replay
from app_ui.stop_lane import GradioQueue
from app_ui.visitors import MB, Visitor, Visitors

logger = logging.getLogger(__name__)
COOKIE = "vlm_visitor"  # a random name per visitor: whose uploads a request may use
_COOKIE_VALUE = re.compile(rb"(?:^|;)\s*" + COOKIE.encode() + rb"=([A-Za-z0-9_-]{20,64})\s*(?:;|$)")
FILE_ROUTES = ("/gradio_api/file=", "/gradio_api/file/")  # Gradio's downloads (the second: its old name)
NO_SUCH_FILE = "no such file"
DECODING_THREADS = 32  # answers whose uploads are decoded at once before they join the line (the jail bounds the decodes)


class Guard:
    """`uploads`: Gradio's upload folder, whose files are downloaded only by their own visitor;
    `answer_group`: the concurrency group of the events that answer, bounded per conversation and
    per address before they join the queue (app_ui/queue_rules.py); `decode(paths, client,
    cancelled)`: decodes an answer's uploads before it joins the line, keeping them in the ledger
    (uploads.decode_uploads: the seconds it took, and the refusal when the time budget ran out),
    None: they are decoded in the answer's slot."""

    def __init__(self, app, visitors: Visitors, uploads: str | None = None, answer_group: str = "generate",
                 decode=None):
        self.app = app
        self.visitors = visitors
        self.uploads = uploads and os.path.abspath(uploads)
        self.group = answer_group
        self.reading = Reading(visitors.limits)
        self.decode = decode
        self.decoding: set[asyncio.Task] = set()  # answers held while their uploads decode
        self.decoders: anyio.CapacityLimiter | None = None  # their threads (made in the server's event loop)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":  # no route of this app takes one: closed before it is accepted
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":  # the lifespan
            return await self.app(scope, receive, send)
        unrouted = routes.refusal(scope["method"], _route_path(scope))  # routes by name, the rest 404
        if unrouted:
            logger.info("refused %s", unrouted)
            return await refuse(send, 404, unrouted)
        path, headers = scope["path"].rstrip("/"), dict(scope.get("headers") or [])
        client = self.client(scope, headers)
        cookie = _COOKIE_VALUE.search(headers.get(b"cookie", b""))
        visitor = Visitor(client, cookie and cookie.group(1).decode())
        scope.setdefault("state", {}).update(arrived=time.perf_counter(), client=client, visitor=visitor)
        if scope["method"] in ("GET", "HEAD") and visitor.cookie is None and (path == "" or path.endswith("/config")):
            send = _with_cookie(send)  # the page and gradio_client's first request: the visitor's cookie
        download = next((scope["path"].split(route, 1)[1] for route in FILE_ROUTES if route in scope["path"]), None)
        if download is not None and not self.may_download(download, visitor):
            return await refuse(send, 404, NO_SUCH_FILE)
        if "deep_link=" in scope.get("query_string", b"").decode("latin-1"):
            return await refuse(send, 404, "deep links are off on this server: each visitor's conversation is private")
        if b"transfer-encoding" in headers:  # a body of unknown length: not taken
            return await refuse(send, 411, "a request body needs a Content-Length")
        length = headers.get(b"content-length", b"0")
        length = int(length) if length.isdigit() else 0
        if scope["method"] == "POST" and path.endswith("/upload"):
            token, refusal = self.visitors.reserve(client, length)
            if refusal:
                return await refuse(send, 429, refusal)
            body = MeteredBody(receive, length, self.visitors, token)
            try:
                return await self.app(scope, body.receive, recording_upload(send, self.visitors, token,
                                                                              visitor.cookie, body))
            finally:
                self.visitors.unreserve(token)
                if body.cut:
                    logger.info("upload from %s cut after %d of %d bytes: %s", client, body.received, length, body.cut)
        limit = self.visitors.limits.request_bytes
        if length > limit:
            return await refuse(send, 413, f"the request is {length / MB:.1f} MB; the limit is {limit / MB:.0f} MB "
                                           "(files go through the upload route)")
        if scope["method"] == "POST":  # /queue/join, /call/<api>...: request data, bounded above
            return await self.checked_post(scope, receive, send, visitor, length)
        return await self.app(scope, receive, send)

    async def checked_post(self, scope, receive, send, visitor: Visitor, length: int):
        """A POST other than an upload: its body read whole (within the reading budget and
        `request_deadline_s`), checked (`check_body`, the route's events, the queue's bounds),
        then handed to Gradio; refused with one line otherwise."""
        path, limits = scope["path"].rstrip("/"), self.visitors.limits
        refusal = self.reading.take(visitor.client, length)
        if refusal:
            return await refuse(send, 503, refusal)
        try:
            body, status, refusal = await read_body(receive, limits.request_bytes, limits.request_deadline_s)
        finally:
            self.reading.give_back(visitor.client, length)
        if refusal:
            logger.info("refused %s from %s: %s", path, visitor.client, refusal)
            return await refuse(send, status, refusal)
        refusal, request = await anyio.to_thread.run_sync(self.check_body, body, visitor)
        blocks, answer = _blocks(scope), False
        unrouted = routes.event_refusal(scope["method"], _route_path(scope), blocks, request)
        if unrouted:
            logger.info("refused %s", unrouted)
            return await refuse(send, 404, unrouted)
        try:
            answer = request is not None and queue_rules.generates(blocks, self.group, path, request)
            refusal = refusal or _event_data_refusal(blocks, path, request)
            if answer and not refusal:
                session_hash = request.get("session_hash") if isinstance(request.get("session_hash"), str) else None
                refusal = queue_rules.refusal(blocks, self.group, session_hash, visitor.client,
                                              limits.answers_per_client)
        except queue_rules.QueueUnreadable as error:  # its bounds cannot be checked: refused
            logger.error("%s", error)
            refusal = "the server cannot check its queue's bounds now, so it takes no requests; try later"
        if refusal:
            logger.info("refused %s from %s: %s", path, visitor.client, refusal)
            return await refuse_json(send, refusal)
        uploads = [path for path in _named_paths(request) if self.visitors.is_upload(path)] \
            if answer and self.decode is not None else []
        try:
            if uploads:
                return await self.join_held(scope, body, send, uploads, visitor.client, blocks)
            return await self.app(scope, replay(body), send)
        finally:
            if answer:
                with contextlib.suppress(queue_rules.QueueUnreadable):  # refused above if so
                    queue_rules.interleave(blocks, self.group)

    async def join_held(self, scope, body: bytes, send, uploads: list[str], client: str, blocks):
        """Gradio's join of an answer that names `uploads`, held in PREPARING from the moment it
        joins (Gradio starts no event meanwhile) while a task decodes them (`prepare`)."""
        queue, joined = GradioQueue(blocks._queue), _Joined(send)
        async with queue.lock:
            await self.app(scope, replay(body), joined.send)
            event = prepare_lane.hold(queue, self.group, joined.event_id)
        if event is not None:
            task = asyncio.get_running_loop().create_task(self.prepare(blocks, event, uploads, client, scope["state"]))
            self.decoding.add(task)
            task.add_done_callback(self.decoding.discard)

    async def prepare(self, blocks, event, uploads: list[str], client: str, state: dict) -> None:
        """Decode a held answer's uploads on a thread, then release it to the answer lane; the
        request's state tells its handler what it took (`images_s`, `images_refused`)."""
        queue = GradioQueue(blocks._queue)
        self.decoders = self.decoders or anyio.CapacityLimiter(DECODING_THREADS)
        try:
            state["images_s"], state["images_refused"] = await anyio.to_thread.run_sync(
                self.decode, uploads, client, lambda: not prepare_lane.held(queue, event), limiter=self.decoders)
        except Exception:  # its handler decodes them then, in its slot
            logger.exception("decoding an answer's uploads before its turn failed")
        finally:
            if await prepare_lane.release(queue, event, self.group):
                with contextlib.suppress(queue_rules.QueueUnreadable):
                    queue_rules.interleave(blocks, self.group)

    def client(self, scope, headers: dict) -> str:
        """The client's address: the socket's, or behind `proxy_hops` trusted proxies the entry
        the nearest one appended to X-Forwarded-For (entries further left are the client's own);
        an IPv6 address counts as its /64 (`bucket`)."""
        hops = self.visitors.limits.proxy_hops
        forwarded = [entry.strip() for entry in headers.get(b"x-forwarded-for", b"").decode("latin-1").split(",")]
        forwarded = [entry for entry in forwarded if entry]
        if hops and len(forwarded) >= hops:
            return bucket(forwarded[-hops])
        return bucket((scope.get("client") or ("unknown",))[0])

    def may_download(self, path: str, visitor: Visitor) -> bool:
        """A file route may answer `path` for `visitor`: never a URL, and in the upload folder only
        the visitor's own uploads (by the path as written, or reached through a link); the rest is
        Gradio's to allow (the examples, its own icons) or refuse."""
        if "://" in path or path.startswith(("//", "\\")) or "\0" in path:
            return False
        if self.uploads is None or self.visitors.may_use(path, visitor):
            return True
        return not (_inside(os.path.abspath(path), self.uploads)
                    or _inside(os.path.realpath(path), os.path.realpath(self.uploads)))

    def check_body(self, body: bytes, visitor: Visitor) -> tuple[str | None, dict | None]:
        """(why a JSON request body is refused, or None; the request parsed, None if it is not
        an object: Gradio answers it)."""
        named, limit = [0], self.visitors.limits.files_per_message

        def count_files(value: dict) -> dict:  # each object as it is parsed: the parse stops past the limit
            if "path" in value or "url" in value:  # keys as parsed: "\u0070ath" is "path" here
                named[0] += 1
                if named[0] > limit:
                    raise TooManyFiles
            return value

        too_many = f"the request names over {limit} files; the limit is {limit} images a message"
        try:
            request = json.loads(body, parse_constant=_not_a_number, object_hook=count_files)
        except RecursionError:
            return "the request is nested too deeply", None
        except NotANumber as error:
            return f"the request holds {error}, which is not a number JSON carries: send finite numbers", None
        except TooManyFiles:
            return too_many, None
        except ValueError:
            return None, None
        if not isinstance(request, dict):
            return None, None
        files = []
        for value in _walk(request):  # data, named arguments, event data: every file the request names
            if isinstance(value, dict) and not isinstance(value.get("files", []), (list, type(None))):
                return f"message 'files' must be a list of files, got {type(value['files']).__name__}", request
            if isinstance(value, dict) and isinstance(value.get("files"), list):  # a message: each file a FileData
                files.extend(file for file in value["files"]  # (those with a path or URL come next, by the walk)
                             if not (isinstance(file, dict) and ("path" in file or "url" in file)))
            if isinstance(value, dict) and ("path" in value or "url" in value):
                files.append(value)
            if len(files) > limit:
                return too_many, request
        for file in files:
            refusal = self.check_file(file, visitor)
            if refusal:
                return refusal, request
        return self.visitors.admit_session(visitor.client, request.get("session_hash")
                                           if isinstance(request.get("session_hash"), str) else None), request

    def check_file(self, file, visitor: Visitor) -> str | None:
        """Why a file a request names is refused: it must be a FileData ({"path": ...}) of one of
        the visitor's own uploads, or of an example. The refusal is the same whether or not a file
        is there."""
        path = file.get("path") if isinstance(file, dict) else None
        shown = repr(path if path is not None else file.get("url", file) if isinstance(file, dict) else file)[:80]
        if isinstance(path, str) and ("://" in path or path.startswith(("http:", "https:", "data:", "file:"))):
            return f"message 'files': {shown} is a URL; this server takes only files uploaded to it (/upload)"
        if not isinstance(path, str) or not path or not self.visitors.may_use(path, visitor):
            return (f"message 'files': {shown} is not a file you uploaded to this server (or it was deleted: "
                    "New chat and idle conversations delete theirs); upload it (/upload) and send the FileData it "
                    "gets, {'path': ...}")
        return None


def bucket(address: str) -> str:
    """The address whose bounds a client shares: an IPv6 address's /64 (one subscriber's
    network: a host picks any address in it), an IPv4 address (mapped into IPv6 or not) itself."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


class NotANumber(ValueError):
    pass


class TooManyFiles(Exception):
    pass


def _not_a_number(constant: str):
    raise NotANumber(constant)


def _route_path(scope) -> str:
    """The path as the app's routes match it: without the root path it is served under, if any
    (as Starlette's router strips it)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _blocks(scope):
    """The Gradio Blocks behind the app (Starlette puts the app in the scope), or None."""
    get_blocks = getattr(scope.get("app"), "get_blocks", None)
    return get_blocks() if get_blocks else None


def _event_data_refusal(blocks, path: str, request: dict | None) -> str | None:
    """Why a request's `event_data` is refused (Gradio would fail on it with a traceback), or None:
    an event whose handler takes its event data (an example's click) needs {"index", "value"}."""
    fn = queue_rules.event_of(blocks, path, request) if request is not None else None
    event_data = request.get("event_data") if request is not None else None
    if fn is None or not queue_rules.takes_event_data(fn):
        return None
    if not (isinstance(event_data, dict) and "index" in event_data and "value" in event_data):
        return 'this event needs its event_data, {"index": ..., "value": ...}, as the page sends it'
    return None


def _named_paths(request: dict | None) -> list[str]:
    """The paths of the files a request names ({"path": ...} anywhere in it), each once."""
    if request is None:
        return []
    return list(dict.fromkeys(value["path"] for value in _walk(request)
                              if isinstance(value, dict) and isinstance(value.get("path"), str)))


class _Joined:
    """A join's `send`, reading the event id Gradio answers ({"event_id": ...})."""

    def __init__(self, send):
        self._send, self.body, self.event_id = send, b"", None

    async def send(self, message):
        if message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                with contextlib.suppress(ValueError, AttributeError):
                    self.event_id = json.loads(self.body).get("event_id")
        await self._send(message)


def _walk(value):
    """Every list, dict and value inside `value`, breadth first, without recursion."""
    pending = [value]
    while pending:
        value = pending.pop()
        yield value
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(os.path.join(folder, ""))


def _with_cookie(send):
    """`send`, adding a new visitor cookie to the response."""
    cookie = f"{COOKIE}={secrets.token_urlsafe(24)}; Path=/; HttpOnly; SameSite=Lax".encode()

    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
        await send(message)

    return sending
