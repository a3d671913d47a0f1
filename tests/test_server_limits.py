"""What one visitor can hold on a public server, and what the others still get (issue 39):
uploads cut short or sent slowly, turns accepted and never answered, a queue flooded by one
address, sessions opened by one address. Each against the real app (`app.main` on the tiny
Qwen2-VL target), as a visitor sends it: raw HTTP and sockets, gradio_client, the page's own
handlers by `fn_index`. Addresses 127.0.x.y stand for visitors.

1. an upload body cut short, or sent too slowly, is cut: its temporary files are deleted, its
   space is free again, no traceback; slow uploads hold no space others could use;
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from gradio.utils import get_upload_folder

from app_ui.visitors import MB, Limits
from tests.helpers import app_fixture, wait_until
from tests.test_hostile import upload

LIMITS = Limits(idle_s=30.0, unsent_upload_s=30.0, upload_bytes_per_client=20 * MB, upload_bytes_total=50 * MB,
                upload_deadline_s=6.0, upload_min_bytes_per_s=64 * 1024, upload_grace_s=1.0, sweep_s=0.5,
                sessions_per_client=64)


server = app_fixture(limits=LIMITS)


@pytest.fixture(scope="module")
def visitors(server):
    """The server's Visitors (the Guard's)."""
    return next(m.kwargs["visitors"] for m in server.demo.app.user_middleware if "visitors" in m.kwargs)


# --- 1. uploads -------------------------------------------------------------------------------------

BOUNDARY = b"vlmtestboundary"


def open_upload(url: str, source: str, data: bytes, declared: int | None = None) -> socket.socket:
    """A raw upload of one file holding `data` from `source`, its Content-Length `declared`
    (default: the whole body's), its body sent as far as `data` goes; the socket, still open."""
    head = (b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="files"; filename="cut.png"\r\n'
            b"Content-Type: image/png\r\n\r\n")
    tail = b"\r\n--" + BOUNDARY + b"--\r\n"
    length = declared if declared is not None else len(head) + len(data) + len(tail)
    host, port = url.split("//")[1].rstrip("/").split(":")
    connection = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
    connection.sendall(b"POST /gradio_api/upload HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
                       b"Content-Type: multipart/form-data; boundary=" + BOUNDARY + b"\r\n"
                       b"Content-Length: " + str(length).encode() + b"\r\n\r\n" + head + data)
    return connection


def response_of(connection: socket.socket) -> tuple[int, str]:
    """(status, body) of the server's answer on `connection` (raises socket.timeout after 30 s)."""
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
        chunk = connection.recv(65536)
        if not chunk:
            break
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def temp_files_holding(marker: bytes) -> list[str]:
    """Files directly in Gradio's upload folder (where its parser writes an upload's temporary
    files) that start with `marker`."""
    folder, found = get_upload_folder(), []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as file:
                if os.path.isfile(path) and file.read(len(marker)) == marker:
                    found.append(path)
        except OSError:
            pass
    return found


def test_an_upload_cut_short_leaves_no_file_and_no_traceback(server, visitors, capfd):
    marker = os.urandom(16)
    data = marker + os.urandom(3 * MB)
    # The client goes 1 kB before the end of its body.
    connection = open_upload(server.url, "127.0.10.1", data, declared=len(data) + 2000)
    wait_until(lambda: temp_files_holding(marker), "the upload's temporary file written")
    connection.close()
    wait_until(lambda: not temp_files_holding(marker), "the cut upload's temporary file deleted", timeout=20)
    wait_until(lambda: not visitors.reserved, "its reservation freed", timeout=20)
    # The client stays but sends no more: cut at the deadline, answered, deleted.
    marker = os.urandom(16)
    data = marker + os.urandom(2 * MB)
    connection = open_upload(server.url, "127.0.10.2", data, declared=len(data) + 2000)
    status, text = response_of(connection)
    connection.close()
    assert status == 408 and "of " in text and "send it again" in text, (status, text)
    wait_until(lambda: not visitors.reserved, "its reservation freed", timeout=10)
    assert not temp_files_holding(marker)
    assert upload(server.url, [("whole.png", os.urandom(MB))], "127.0.10.2").status_code == 200
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, err


def test_slow_uploads_hold_no_space_that_other_visitors_need(server, visitors):
    # Three addresses declare 15 MB each (45 of the server's 50 MB) and send a few bytes.
    slow = [open_upload(server.url, f"127.0.11.{i + 1}", b"\x89PNG", declared=15 * MB) for i in range(3)]
    wait_until(lambda: len(visitors.reserved) == 3, "three slow uploads in progress")
    # Another visitor's 9 MB upload is taken: nobody is using that space.
    response = upload(server.url, [("visitor.png", os.urandom(9 * MB))], "127.0.11.10")
    assert response.status_code == 200, response.text
    started = time.monotonic()
    for connection in slow:  # each is cut once it falls under the minimum rate after the grace time
        status, text = response_of(connection)
        connection.close()
        assert status == 408 and "arrived too slowly" in text, (status, text)
    assert time.monotonic() - started < LIMITS.upload_deadline_s
    wait_until(lambda: not visitors.reserved, "the slow uploads' reservations freed", timeout=10)


def test_escaped_keys_are_counted_as_the_parse_reads_them(server, monkeypatch):
    import gradio.processing_utils
    import httpx

    checked = []
    check_allowed = gradio.processing_utils._check_allowed
    monkeypatch.setattr(gradio.processing_utils, "_check_allowed",
                        lambda path, *args: checked.append(path) or check_allowed(path, *args))
    files = ",".join('{"\\u0070ath": "/tmp/gradio/x%d/a.png", "meta": {"_type": "gradio.FileData"}}' % i
                     for i in range(3000))
    body = '{"data": [{"text": "Hi", "files": [%s]}]}' % files
    response = httpx.post(server.url + "gradio_api/call/chat", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["error"] == \
        "the request names over 64 files; the limit is 64 images a message"
    assert checked == []
