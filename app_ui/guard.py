"""`Guard`: the ASGI middleware in front of Gradio (see app_ui/visitors.py for what it bounds).

Cheap checks come first, before Gradio reads, hashes or copies anything: the path, the
headers, the Content-Length; then, for a JSON body (bounded by `Limits.request_bytes`), one
parse in a worker thread that counts the files the request names as it goes (keys as JSON
reads them, escaped or not; it stops past the limit) and checks where each is,
without touching the disk. A refusal is one line naming the problem: text for an upload, and
for a JSON request the 422 shape Gradio's clients show as a validation message.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import time

import anyio

from app_ui import queue_rules
from app_ui.visitors import MB, Visitors

logger = logging.getLogger(__name__)

class Guard:
    """`file_folders`: where the files a request names may be (Gradio's upload folder, the
    examples); `answer_group`: the concurrency group of the events that answer, bounded per
    conversation and per address before they join the queue (app_ui/queue_rules.py)."""

    def __init__(self, app, visitors: Visitors, file_folders: list[str] = (), answer_group: str = "generate"):
        self.app = app
        self.visitors = visitors
        self.group = answer_group  # the concurrency group whose events answer (app_ui/queue_rules.py)
        self.folders = [os.path.join(os.path.abspath(folder), "") for folder in file_folders]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"].rstrip("/"), dict(scope.get("headers") or [])
        client = self.client(scope, headers)
        scope.setdefault("state", {}).update(arrived=time.perf_counter(), client=client)
        if path.endswith("/deep_link") or "deep_link=" in scope.get("query_string", b"").decode("latin-1"):
            return await refuse(send, 404, "deep links are off on this server: each visitor's conversation is private")
        if "/monitoring" in path:
            return await refuse(send, 404, "monitoring is off on this server")
        if b"transfer-encoding" in headers:  # a body of unknown length: not taken
            return await refuse(send, 411, "a request body needs a Content-Length")
        length = headers.get(b"content-length", b"0")
        length = int(length) if length.isdigit() else 0
        if scope["method"] == "POST" and path.endswith("/upload"):
            token, refusal = self.visitors.reserve(client, length)
            if refusal:
                return await refuse(send, 429, refusal)
            body = _MeteredBody(receive, length, self.visitors, token)
            try:
                return await self.app(scope, body.receive, _recording_upload(send, self.visitors, token, body))
            finally:
                self.visitors.unreserve(token)
                if body.cut:
                    logger.info("upload from %s cut after %d of %d bytes: %s", client, body.received, length, body.cut)
        limit = self.visitors.limits.request_bytes
        if length > limit:
            return await refuse(send, 413, f"the request is {length / MB:.1f} MB; the limit is {limit / MB:.0f} MB "
                                           "(files go through the upload route)")
        if scope["method"] == "POST":  # /queue/join, /call/<api>...: request data, bounded above
            body = await _read_body(receive, limit)
            if body is None:
                return await refuse(send, 413, f"the request is over the limit of {limit / MB:.0f} MB")
            refusal, request = await anyio.to_thread.run_sync(self.check_body, body, client)
            blocks = _blocks(scope)
            answer = request is not None and queue_rules.generates(blocks, self.group, path, request)
            if answer and not refusal:
                session_hash = request.get("session_hash") if isinstance(request.get("session_hash"), str) else None
                refusal = queue_rules.refusal(blocks, self.group, session_hash, client,
                                              self.visitors.limits.answers_per_client)
            if refusal:
                logger.info("refused %s from %s: %s", path, client, refusal)
                return await refuse_json(send, refusal)
            try:
                return await self.app(scope, _replay(body), send)
            finally:
                if answer:
                    queue_rules.interleave(blocks, self.group)
        return await self.app(scope, receive, send)

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

    def check_body(self, body: bytes, client: str) -> tuple[str | None, dict | None]:
        """(why a JSON request body is refused, or None; the request parsed, None if it is not
        an object: Gradio answers it)."""
        files, limit = [], self.visitors.limits.files_per_message

        def count_files(value: dict) -> dict:  # each object as it is parsed: the parse stops past the limit
            if "path" in value or "url" in value:  # keys as parsed: "\u0070ath" is "path" here
                files.append(value)
                if len(files) > limit:
                    raise TooManyFiles
            return value

        try:
            request = json.loads(body, parse_constant=_not_a_number, object_hook=count_files)
        except RecursionError:
            return "the request is nested too deeply", None
        except NotANumber as error:
            return f"the request holds {error}, which is not a number JSON carries: send finite numbers", None
        except TooManyFiles:
            return f"the request names over {limit} files; the limit is {limit} images a message", None
        except ValueError:
            return None, None
        if not isinstance(request, dict):
            return None, None
        for value in _walk(request.get("data")):
            if isinstance(value, dict) and not isinstance(value.get("files", []), (list, type(None))):
                return f"message 'files' must be a list of files, got {type(value['files']).__name__}", request
        for file in files:
            refusal = self.check_file(file)
            if refusal:
                return refusal, request
        return self.visitors.admit_session(client, request.get("session_hash")
                                           if isinstance(request.get("session_hash"), str) else None), request

    def check_file(self, file: dict) -> str | None:
        """Why a file a request names is refused: it must be a path in one of `folders`."""
        path = file.get("path")
        shown = repr(path if path is not None else file.get("url"))[:80]
        if not isinstance(path, str) or not path:
            return f"message 'files': {shown} is not a file path; upload the file and send the path it gets"
        if "://" in path or path.startswith(("http:", "https:", "data:", "file:")):
            return f"message 'files': {shown} is a URL; this server takes only files uploaded to it (/upload)"
        if not any(os.path.abspath(path).startswith(folder) for folder in self.folders):
            return f"message 'files': {shown} is not a file uploaded to this server (upload it first: /upload)"
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


def _blocks(scope):
    """The Gradio Blocks behind the app (Starlette puts the app in the scope), or None."""
    get_blocks = getattr(scope.get("app"), "get_blocks", None)
    return get_blocks() if get_blocks else None


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


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None when it runs over `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes):
    """A `receive` that gives `body` once, then waits for the client to go, as the server's does."""
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()

    return receive


class _MeteredBody:
    """An upload's `receive`: counts its bytes (`Visitors.received`) and cuts the body when it
    ends before its Content-Length (the client went), runs past `upload_deadline_s`, falls
    under `upload_min_bytes_per_s` on average after `upload_grace_s`, or takes the server past
    its upload space. A cut raises Gradio's MultiPartException inside its multipart parser,
    whose own error path closes and deletes the request's temporary files; Gradio then answers
    400 with the reason, which `status` turns into 408 or 429."""

    def __init__(self, receive, length: int, visitors: Visitors, token: int):
        self._receive, self.length, self.visitors, self.token = receive, length, visitors, token
        self.started, self.received, self.done = time.monotonic(), 0, False
        self.cut, self.status = "", 400

    async def receive(self):
        if self.done:  # the whole body is in: what follows (a disconnect) is Gradio's to see
            return await self._receive()
        limits = self.visitors.limits
        rate = max(limits.upload_min_bytes_per_s, 1)
        by = min(self.started + limits.upload_deadline_s,  # the next byte is due by then
                 self.started + limits.upload_grace_s + (self.received + 1) / rate)
        with anyio.move_on_after(max(0.0, by - time.monotonic())) as waited:
            message = await self._receive()
        if waited.cancelled_caught:
            seconds = time.monotonic() - self.started
            why = (f"the upload took over {limits.upload_deadline_s:g} s" if seconds >= limits.upload_deadline_s else
                   f"the upload arrived too slowly ({self.received / max(seconds, 1e-9) / 1024:.1f} kB/s; the server "
                   f"takes {rate / 1024:g} kB/s at least)")
            return self._cut(408, f"{why}; {self.received:,} of {self.length:,} bytes came: send it again")
        if message["type"] != "http.request":
            return self._cut(400, f"the upload ended after {self.received:,} of its {self.length:,} bytes")
        chunk = message.get("body", b"")
        self.received += len(chunk)
        refusal = self.visitors.received(self.token, len(chunk))
        if refusal:
            return self._cut(429, refusal)
        self.done = not message.get("more_body")
        return message

    def _cut(self, status: int, why: str):
        from gradio.route_utils import MultiPartException

        self.cut, self.status = why, status
        raise MultiPartException(why)


def _recording_upload(send, visitors: Visitors, token: int, metered: _MeteredBody):
    """`send`, holding back a successful upload response until its paths are recorded as
    upload `token`'s; one that takes the client over its file count is answered 429 instead.
    An upload whose body was cut (`metered`) is answered with the cut's status."""
    start, body = [None], []

    async def recording(message):
        if message["type"] == "http.response.start":
            start[0] = message
            if message["status"] != 200:
                await send({**message, "status": metered.status} if metered.cut else message)
            return
        if start[0]["status"] != 200:
            return await send(message)
        body.append(message.get("body", b""))
        if message.get("more_body"):
            return
        try:
            paths = json.loads(b"".join(body))
        except ValueError:
            paths = []
        refusal = visitors.uploaded(token, [p for p in paths if isinstance(p, str)] if isinstance(paths, list) else [])
        if refusal:
            return await refuse(send, 429, refusal)
        await send(start[0])
        await send({"type": "http.response.body", "body": b"".join(body)})

    return recording


async def refuse(send, status: int, text: str) -> None:
    await _answer(send, status, text.encode(), b"text/plain; charset=utf-8")


async def refuse_json(send, text: str) -> None:
    """422 in the shape of Gradio's validation errors: gradio_client raises it as ValidationError
    with `text`, and the page shows it."""
    detail = [{"__type__": "validate", "is_valid": False, "parameter_name": "request", "message": text}]
    await _answer(send, 422, json.dumps({"detail": detail, "error": text}).encode(), b"application/json")


async def _answer(send, status: int, body: bytes, kind: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
