"""What one visitor can hold on a public server, and what the others still get (issue 39):
uploads cut short or sent slowly, turns accepted and never answered, a queue flooded by one
address, sessions opened by one address. Each against the real app (`app.main` on the tiny
Qwen2-VL target), as a visitor sends it: raw HTTP and sockets, gradio_client, the page's own
handlers by `fn_index`. Addresses 127.0.x.y stand for visitors.

1. an upload body cut short, or sent too slowly, is cut: its temporary files are deleted, its
   space is free again, no traceback; slow uploads hold no space others could use; files are
   counted as the parse reads their keys;
2. a turn accepted whose answer never comes expires and frees its files; a respond step with a
   bad setting clears its turn; Stop clears a turn whose answer never came;
3. one address cannot fill the queue: one answer waiting per conversation, a few per address,
   and another visitor's answer runs next; its statistics count the wait.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from gradio.utils import get_upload_folder

import threading

import httpx
from gradio_client import Client
from gradio_client.exceptions import ValidationError

from app_ui import queue_rules
from app_ui.visitors import MB, Limits
from tests.helpers import Gate, app_fixture, message, wait_until
from tests.test_hostile import SETTINGS, api_call, chat_data, file_data, fn_index, page_call, upload

LIMITS = Limits(idle_s=30.0, unsent_upload_s=30.0, upload_bytes_per_client=20 * MB, upload_bytes_total=50 * MB,
                upload_deadline_s=6.0, upload_min_bytes_per_s=64 * 1024, upload_grace_s=1.0, sweep_s=0.5,
                sessions_per_client=64, pending_turn_s=2.0, answers_per_client=3)


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


# --- 2. turns accepted and never answered ------------------------------------------------------------

def page_run(url: str, fn: int, data: list, session_hash: str, source: str) -> httpx.Response:
    """An event of the page that skips the queue (Stop), as the browser sends it."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as client:
        return client.post(url + "gradio_api/run/predict", json={"data": data, "fn_index": fn, "session_hash": session_hash,
                                                                 "event_data": None, "trigger_id": None})


def test_a_turn_whose_answer_never_comes_expires_and_bad_settings_or_stop_clear_it(server, visitors):
    demo, source = server.demo, "127.0.12.1"
    accept, respond = fn_index(demo, "accept"), fn_index(demo, "respond")
    settings = [SETTINGS[name] for name in SETTINGS]
    # The accept step alone: the turn expires after pending_turn_s and its upload is deleted.
    (path,) = upload(server.url, [("pending.png", os.urandom(2000))], source).json()
    sent = {"text": "Describe it.", "files": [file_data(path)]}
    assert page_call(server.url, accept, [sent, None], "pending-1", source)[0] == "complete"
    wait_until(lambda: not os.path.exists(path), "the unanswered turn's upload deleted", timeout=20)
    kind, outputs = page_call(server.url, accept, [{"text": "Hi", "files": []}, None], "pending-1", source)
    assert kind == "complete", outputs  # not "an answer is still streaming"
    # A respond step with a setting the page's slider would refuse (temperature 2.0, over its 1.5) or that
    # the schema refuses (-1): the first is answered, the second named; neither leaves the turn pending.
    for temperature in (2.0, -1):
        values = [{**SETTINGS, "temperature": temperature}[name] for name in SETTINGS]
        kind, outputs = page_call(server.url, respond, [None, *values], "pending-1", source)
        assert kind == "complete", (temperature, outputs)
        kind, outputs = page_call(server.url, accept, [{"text": "Again", "files": []}, None], "pending-1", source)
        assert kind == "complete", (temperature, outputs)
    # Stop clears a turn whose respond step never came, at once.
    assert page_run(server.url, fn_index(demo, "stop"), [None], "pending-1", source).status_code == 200
    kind, outputs = page_call(server.url, accept, [{"text": "Hi", "files": []}, None], "pending-1", source)
    assert kind == "complete", outputs
    assert page_call(server.url, respond, [None, *settings], "pending-1", source)[0] == "complete"


# --- 3. the queue -------------------------------------------------------------------------------------

def test_one_address_cannot_fill_the_queue_and_another_visitor_answers_next(server, visitors):
    waiting = lambda: queue_rules._waiting(server.demo, "generate")  # noqa: E731
    results, finished = {}, []

    def ask(name: str, source: str):
        results[name] = api_call(server.url, "chat", chat_data(f"Question {name}."), source)
        finished.append(name)

    def start(name: str, source: str, queued: int) -> threading.Thread:
        thread = threading.Thread(target=ask, args=(name, source))
        thread.start()
        wait_until(lambda: len(waiting()) == queued, f"{name} waiting in the queue")
        return thread

    flood, visitor = "127.0.13.1", "127.0.13.2"
    with Gate(server.engine.target.runner) as gate:
        threads = [threading.Thread(target=ask, args=("x1", flood))]
        threads[0].start()
        gate.wait()  # x1 runs, held
        threads += [start("x2", flood, 1), start("x3", flood, 2)]
        kind, refusal = api_call(server.url, "chat", chat_data("Question x4."), flood)
        assert kind == "refused" and refusal == ("3 answers from your address are waiting or running, the limit "
                                                 "is 3: wait for one to end"), (kind, refusal)
        threads.append(start("visitor", visitor, 3))
        queued_at = time.perf_counter()
        # One conversation (gradio_client keeps one) may have one answer waiting.
        client = Client(server.url, verbose=False)
        job = client.submit(message("Mine."), mode="plain", max_new_tokens=3, api_name="/chat")
        wait_until(lambda: len(waiting()) == 4, "the client's answer waiting")
        with pytest.raises(ValidationError, match="this conversation already has an answer waiting in the queue"):
            client.predict(message("Mine again."), mode="plain", max_new_tokens=3, api_name="/chat")
        released_at = time.perf_counter()
    for thread in threads:
        thread.join(120)
    job.result(timeout=120)
    assert all(kind == "complete" for kind, _ in results.values()), results
    # The other visitor's answer ran right after the one that was running: before x2 and x3.
    assert finished.index("visitor") < finished.index("x2") < finished.index("x3"), finished
    _, stats = results["visitor"][1]
    assert stats["queue_wait_s"] >= released_at - queued_at and stats["ttft_s"] >= stats["queue_wait_s"], stats
    assert stats["prepare_s"] >= stats["queue_wait_s"]


# --- 4. sessions per address --------------------------------------------------------------------------

def test_past_its_sessions_an_address_closes_its_own_oldest_idle_one_and_ipv6_counts_per_64(server, visitors,
                                                                                            monkeypatch):
    import dataclasses

    from app_ui.guard import Guard

    monkeypatch.setattr(visitors, "limits", dataclasses.replace(LIMITS, sessions_per_client=3))
    demo, source = server.demo, "127.0.14.1"
    accept, respond = fn_index(demo, "accept"), fn_index(demo, "respond")
    settings = [SETTINGS[name] for name in SETTINGS]

    def converse(session: str, text: str) -> tuple[str, object]:
        accepted = page_call(server.url, accept, [{"text": text, "files": []}, None], session, source)
        return accepted if accepted[0] != "complete" else page_call(server.url, respond, [None, *settings], session, source)

    for i in range(3):
        assert converse(f"nat-{i}", "Hi")[0] == "complete"
    # A fourth visitor behind the same address is let in: the oldest idle conversation (nat-0) is closed.
    assert converse("nat-3", "Hi")[0] == "complete"
    kind, error = page_call(server.url, accept, [{"text": "And now?", "files": []}, None], "nat-0", source)
    assert kind == "error" and "the server dropped this conversation to make room" in str(error), (kind, error)
    assert sum(known.client == source for known in visitors.known.values()) == 3
    # IPv6: every address of one /64 is one client.
    guard = Guard(None, visitors)
    assert {guard.client({"client": (f"2001:db8:5:6::{i:x}", 1)}, {}) for i in range(1, 200)} == {"2001:db8:5:6::/64"}
    assert guard.client({"client": ("2001:db8:5:7::1", 1)}, {}) == "2001:db8:5:7::/64"
