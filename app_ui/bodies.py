"""Request bodies, as the Guard (app_ui/guard.py) takes them before Gradio does: an upload's
metered as it arrives (`MeteredBody`: a deadline, a least rate, the server's upload space, the
name of each part) and its answer held back until its files are recorded (`recording_upload`);
any other body read whole within its size, its deadline and the bodies being read at once
(`Reading`, `read_body`), then handed to Gradio (`replay`); and the one-line refusals
(`refuse`, `refuse_json`).
"""

from __future__ import annotations

import json
import re
import time

import anyio

from app_ui.visitors import MB, Visitors


class Reading:
    """The request bodies (not uploads) being read now, by their Content-Length: bounded per
    address and in all, so that slow or stalled bodies cannot fill the server's memory. Used
    from the server's event loop only (no lock)."""

    def __init__(self, limits):
        self.limits, self.bytes, self.total = limits, {}, 0

    def take(self, client: str, size: int) -> str | None:
        """Count `size` bytes for `client` (None), or say why not (nothing is counted)."""
        mine = self.bytes.get(client, 0)
        if mine + size > self.limits.request_bytes_per_client:
            return (f"requests from your address being read hold {mine / MB:.1f} MB and this one is {size / MB:.1f} "
                    f"MB; the limit is {self.limits.request_bytes_per_client / MB:.0f} MB: wait for them to finish")
        if self.total + size > self.limits.request_bytes_total:
            return "the server is reading too many requests at once; try again in a moment"
        self.bytes[client], self.total = mine + size, self.total + size
        return None

    def give_back(self, client: str, size: int) -> None:
        self.total -= size
        self.bytes[client] -= size
        if not self.bytes[client]:
            del self.bytes[client]


async def read_body(receive, limit: int, deadline_s: float) -> tuple[bytes, int, str | None]:
    """(the whole request body, 200, None), or (b"", status, why not): it ran over `limit` bytes
    (413), did not arrive within `deadline_s` (408), or the client went before it ended (400:
    nothing is parsed then)."""
    chunks, size = [], 0
    with anyio.move_on_after(deadline_s):
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", 400, f"the client went after {size:,} bytes of its request"
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", 413, f"the request is over the limit of {limit / MB:.0f} MB"
            if not message.get("more_body"):
                return b"".join(chunks), 200, None
    return b"", 408, f"the request's body did not arrive within {deadline_s:g} s ({size:,} bytes came): send it again"


def replay(body: bytes):
    """A `receive` that gives `body` once, then waits for the client to go, as the server's does."""
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()

    return receive


class MeteredBody:
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
        self.seen = b""  # the end of the body so far: a part's header may straddle two chunks

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
        named, self.seen = unnamed_part(self.seen + chunk), (self.seen + chunk)[-PART_HEADER_BYTES:]
        if named:  # before Gradio parses the part: it would keep what came, or fail with a traceback
            return self._cut(400, named)
        self.done = not message.get("more_body")
        return message

    def _cut(self, status: int, why: str):
        from gradio.route_utils import MultiPartException

        self.cut, self.status = why, status
        raise MultiPartException(why)


PART_HEADER_BYTES = 1024
_PART_HEADER = re.compile(rb"content-disposition:([^\r\n]*)\r\n", re.IGNORECASE)
_FILENAME = re.compile(rb';\s*filename(\*?)\s*=\s*("[^"]*"|[^;]*)', re.IGNORECASE)


def unnamed_part(text: bytes) -> str | None:
    """Why a part of a multipart upload whose header is in `text` is refused, or None: each
    part must be a file under a plain filename (Gradio reads `filename*=` or no filename as a
    form field, and fails with a traceback), and not ".." (Gradio refuses it after writing the
    request's files, and keeps them)."""
    for header in _PART_HEADER.finditer(text):
        names = _FILENAME.findall(header.group(1))
        if not names or any(star for star, _ in names):
            return ("each part of an upload must be a file with a plain file name (filename=\"...\"; not "
                    "filename*=): send it again")
        name = names[0][1].strip().strip(b'"').replace(b"\\", b"/").rsplit(b"/", 1)[-1]
        if name.strip() in (b"..", b"."):
            return f"the file name {name.decode('latin-1')!r} is not one the server takes: rename the file"
    return None


def recording_upload(send, visitors: Visitors, token: int, cookie: str | None, metered: MeteredBody):
    """`send`, holding back a successful upload response until its paths are recorded as
    upload `token`'s (of the visitor with `cookie`) and answering the private paths they were
    moved to; one that takes the client over its file count is answered 429 instead. An upload
    whose body was cut (`metered`) is answered with the cut's status."""
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
        paths, refusal = visitors.uploaded(token, [p for p in paths if isinstance(p, str)]
                                           if isinstance(paths, list) else [], cookie)
        if refusal:
            return await refuse(send, 429, refusal)
        answer = json.dumps(paths).encode()
        headers = [(k, v) for k, v in start[0].get("headers", []) if k.lower() != b"content-length"]
        await send({**start[0], "headers": [*headers, (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

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
