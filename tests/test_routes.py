"""The public server's boundary (issue 57, issue 61 item 10), against the real app (`app.main` on
the tiny Qwen2-VL target), with raw HTTP as a hostile visitor sends it; addresses 127.0.0.x.

1. routes by name: every route Gradio's app registers is allowed or refused in
   app_ui/routes.py, and the refused ones (call/v2, run/ for a queued event, process_recording,
   ...) answer 404 before Gradio reads a byte;
2. the file check reads every file a request names, wherever it sits;
3. a check that cannot find what it checks refuses: Gradio's queue unreadable, a request without
   its queue or address, a claim without a visitor;
4. every request body has a size, a deadline and a share of the reading budget; an upload under
   a name Gradio would keep or fail on is refused before Gradio parses it; X-Forwarded-For is
   trusted by no one but the Guard, and only as configured; visitor mistakes are one line;
5. every upload is released exactly once, whatever a visitor does: random sequences of the
   page's actions and API calls end with nothing on disk and nothing in the address's quota.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.routing import APIRoute
from gradio_client import Client
from gradio.utils import get_upload_folder
from PIL import Image, PngImagePlugin
from starlette.routing import Mount, Route

from app_ui import callbacks, queue_rules, routes
from app_ui.guard import Guard
from app_ui.session import Session
from app_ui.visitors import MB, Limits, Visitors
from engine.engine import RequestError
from tests.helpers import Gate, app_fixture, message, wait_until
from tests.test_hostile import SETTINGS, chat_data, file_data, fn_index
from tests.test_server_limits import response_of
from tests.test_privacy import Visitor, picture

LIMITS = Limits(idle_s=3600.0, unsent_upload_s=600.0, upload_bytes_per_client=20 * MB, sessions_per_client=40,
                sweep_s=3600.0, request_bytes=1 * MB, request_bytes_per_client=1 * MB + 1000, request_deadline_s=3.0,
                answers_per_client=8)
server = app_fixture(limits=LIMITS)


@pytest.fixture(scope="module")
def visitors(server):
    return next(m.kwargs["visitors"] for m in server.demo.app.user_middleware if "visitors" in m.kwargs)


def registered(app_routes, prefix: str = "") -> list[tuple[str, str]]:
    """(method, path template) of every route the app registers, those of included routers and
    mounts too; a kind of route it cannot read fails the test (it would go unclassified)."""
    found = []
    for route in app_routes:
        if isinstance(route, (APIRoute, Route)):
            found += [(method, prefix + route.path) for method in sorted(route.methods)]
        elif isinstance(route, Mount):
            found += [("GET", prefix + route.path + "/{path:path}")] if route.routes is None or not route.routes \
                else registered(route.routes, prefix + route.path)
        elif hasattr(route, "original_router"):  # FastAPI's included router: its routes carry its prefix
            found += registered(route.original_router.routes, prefix + route.include_context.prefix)
        else:
            raise AssertionError(f"a route of a kind this test cannot read: {type(route).__name__}")
    return found


# --- 1. routes by name ----------------------------------------------------------------------------------

def test_every_route_gradio_registers_is_allowed_or_refused_by_name(server):
    found = registered(server.demo.app.routes)
    assert len(found) > 60  # the walk reached Gradio's own routes (its included router)
    unclassified = sorted({(method, path) for method, path in found if routes.classified(method, path) is None})
    assert not unclassified, f"routes app_ui/routes.py does not classify (allow or refuse, with a reason): {unclassified}"
    listed = {(method, route.template) for route in routes.ROUTES for method in route.methods}
    stale = listed - {(method, path.rstrip("/") or "/") for method, path in found}
    assert not stale, f"app_ui/routes.py lists routes Gradio no longer registers: {sorted(stale)}"
    assert all(route.reason for route in routes.ROUTES)


def test_routes_off_the_list_answer_404_before_gradio_reads_them(server, visitors):
    victim = Visitor(server.url, "127.0.0.21")
    theirs = victim.upload("private.png", picture(21))
    attacker = Visitor(server.url, "127.0.0.22")
    message = {"text": "Describe the image.", "files": [file_data(theirs)]}
    probes = [("POST", "gradio_api/call/v2/chat", {"message": message, **SETTINGS}),
              ("POST", "gradio_api/call/v2/ab", {"data": [], "message": message}),
              ("POST", "gradio_api/run/chat", {"data": [message, None, *SETTINGS.values()]}),
              ("POST", "gradio_api/run/predict", {"data": [None, *SETTINGS.values()], "session_hash": "run-1",
                                                  "fn_index": fn_index(server.demo, "respond")}),  # queued event
              ("POST", "gradio_api/api/chat", {"data": [message, None, *SETTINGS.values()]}),
              ("POST", "gradio_api/process_recording", {}),
              ("GET", "gradio_api/queue/status", None), ("GET", "gradio_api/runs", None),
              ("GET", "monitoring", None), ("GET", "gradio_api/deep_link", None), ("GET", "no/such/route", None),
              ("OPTIONS", "gradio_api/queue/join", None)]
    for method, path, body in probes:
        response = attacker.http.request(method, server.url + path, json=body)
        assert response.status_code == 404, (path, response.status_code, response.text)
        assert response.text.startswith(f"{method} /{path}"), response.text  # one named line
    assert theirs in visitors.uploads and not any(id_ for id_ in visitors.uploads[theirs].owners)


def test_the_stop_button_route_that_skips_the_queue_still_answers(server):
    visitor = Visitor(server.url, "127.0.0.23")
    stop = server.demo.fns[fn_index(server.demo, "stop")]
    assert stop.queue is False and stop.api_name == "stop"
    body = {"data": [None], "event_data": None, "fn_index": stop._id, "session_hash": "stopper-1", "trigger_id": None}
    response = visitor.http.post(server.url + "gradio_api/run/stop", json=body)
    assert response.status_code == 200, response.text


# --- 2. every file a request names ------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["event_data", "named", "nested"])
def test_a_file_anywhere_in_a_request_must_be_the_visitors_own(server, where):
    victim = Visitor(server.url, "127.0.0.24")
    theirs = victim.upload("private.png", picture(24))
    attacker = Visitor(server.url, "127.0.0.25")
    accept = fn_index(server.demo, "accept")
    body = {"data": [{"text": "hi", "files": []}, None], "fn_index": accept, "session_hash": f"anywhere-{where}",
            "trigger_id": None, "event_data": None}
    if where == "event_data":
        body["event_data"] = {"index": 0, "value": {"file": file_data(theirs)}}
    elif where == "named":
        body["message"] = {"text": "hi", "files": [file_data(theirs)]}
    else:
        body["data"][0]["meta"] = [[{"deeper": file_data(theirs)}]]
    response = attacker.http.post(server.url + "gradio_api/queue/join", json=body)
    assert response.status_code == 422, response.text
    assert "is not a file you uploaded" in response.json()["error"] and repr(theirs)[:80] in response.json()["error"]


# --- 3. a check that cannot find what it checks refuses -------------------------------------------------------

def test_gradios_queue_read_without_defaults_refuses_when_a_field_is_gone(server):
    queue_rules.check_readable(server.demo)  # the real queue: every field there
    renamed = SimpleNamespace(_queue=SimpleNamespace(event_queue_per_concurrency_id={}), fns=server.demo.fns)
    with pytest.raises(queue_rules.QueueUnreadable, match="active_jobs"):
        queue_rules.check_readable(renamed)
    with pytest.raises(queue_rules.QueueUnreadable, match="active_jobs"):
        queue_rules.refusal(renamed, "generate", "a-session", "127.0.0.1", 4)
    lane = SimpleNamespace(queue=[SimpleNamespace(session_hash="x", request=SimpleNamespace(scope={}))])
    unstamped = SimpleNamespace(_queue=SimpleNamespace(event_queue_per_concurrency_id={"generate": lane},
                                                       active_jobs=[]))
    with pytest.raises(queue_rules.QueueUnreadable, match="state"):  # an event without the Guard's address
        queue_rules.refusal(unstamped, "generate", "a-session", "127.0.0.1", 4)


def test_the_guard_refuses_answers_when_it_cannot_read_the_queue(server, monkeypatch):
    def unreadable(*args):
        raise queue_rules.QueueUnreadable("Gradio's queue is not as app_ui/queue_rules.py reads it (test)")

    monkeypatch.setattr(queue_rules, "refusal", unreadable)
    visitor = Visitor(server.url, "127.0.0.26")
    response = visitor.http.post(server.url + "gradio_api/call/chat",
                                 json={"data": [{"text": "hi", "files": []}, *SETTINGS.values()]})
    assert response.status_code == 422 and "cannot check its queue" in response.json()["error"], response.text


def test_check_queue_and_claim_refuse_without_what_they_check(visitors, tmp_path):
    with pytest.raises(RequestError, match="cannot check its queue's bounds"):
        callbacks.check_queue(None, visitors)
    no_address = SimpleNamespace(request=SimpleNamespace(app=None, state=SimpleNamespace()), session_hash="s")
    with pytest.raises(RequestError, match="cannot check its queue's bounds"):
        callbacks.check_queue(no_address, visitors)
    own = Visitors(Limits())
    path = str(tmp_path / "upload" / "photo.png")
    os.makedirs(os.path.dirname(path))
    open(path, "wb").write(picture(27))
    token, _ = own.reserve("127.0.0.27", 100)
    (stored,), refusal = own.uploaded(token, [path], cookie="c" * 32)
    assert refusal is None
    assert own.claim(Session(), [stored], None) == stored  # no visitor to check against: refused
    assert own.claim(Session(), [stored], None) == stored
    from app_ui.visitors import Visitor as Who
    assert own.claim(Session(), [stored], Who("127.0.0.27", "c" * 32)) is None
    assert json.dumps(own.uploads[os.path.abspath(stored)].owners, default=list)


# --- 4. bodies, upload names, forwarded addresses, visitor mistakes --------------------------------------------

def guard_of(server) -> Guard:
    node = server.demo.app.middleware_stack
    while not isinstance(node, Guard):
        node = node.app  # AttributeError: no Guard in the app's middleware
    return node


def raw_post(url: str, path: str, source: str, head: dict[str, str], body: bytes) -> socket.socket:
    """A POST whose body is sent as far as `body` goes; the socket, still open."""
    host, port = url.split("//")[1].rstrip("/").split(":")
    connection = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
    lines = "".join(f"{name}: {value}\r\n" for name, value in {"Host": host, **head}.items())
    connection.sendall(f"POST /{path} HTTP/1.1\r\n{lines}\r\n".encode() + body)
    return connection


def test_a_request_body_has_a_deadline_a_reading_budget_and_is_not_parsed_after_its_client_went(server,
                                                                                                  monkeypatch):
    guard, parsed = guard_of(server), []
    check_body = guard.check_body
    monkeypatch.setattr(guard, "check_body", lambda body, visitor: parsed.append(body) or check_body(body, visitor))
    head = {"Content-Type": "application/json", "Content-Length": str(LIMITS.request_bytes)}
    stalled = raw_post(server.url, "gradio_api/queue/join", "127.0.0.41", head, b'{"data": [')
    wait_until(lambda: guard.reading.total == LIMITS.request_bytes, "the stalled body counted")
    # The same address has no budget left for another body; another address has its own.
    over = raw_post(server.url, "gradio_api/queue/join", "127.0.0.41", {**head, "Content-Length": "2000"}, b"{}")
    status, text = response_of(over)
    assert status == 503 and "requests from your address being read hold 1.0 MB" in text, text
    other = Visitor(server.url, "127.0.0.42").http.post(server.url + "gradio_api/queue/join", json={"data": []})
    assert other.status_code != 503, other.text
    status, text = response_of(stalled)  # the deadline
    assert status == 408 and f"did not arrive within {LIMITS.request_deadline_s:g} s" in text, text
    # A client that goes before its body ends: nothing of it is parsed, and its bytes are given back.
    count = len(parsed)
    gone = raw_post(server.url, "gradio_api/queue/join", "127.0.0.43", head, b'{"data": [1, 2')
    wait_until(lambda: guard.reading.total == LIMITS.request_bytes, "the cut body counted")
    gone.close()
    wait_until(lambda: guard.reading.total == 0, "the budget given back")
    assert len(parsed) == count


@pytest.mark.parametrize("disposition, refusal", [
    ('name="files"; filename=".."', "the file name '..' is not one the server takes"),
    ('name="files"; filename="folder/.."', "the file name '..' is not one the server takes"),
    ("name=\"files\"; filename*=utf-8''photo.png", "must be a file with a plain file name"),
    ('name="files"', "must be a file with a plain file name")])
def test_an_upload_gradio_would_keep_or_fail_on_is_refused_by_name_and_leaves_nothing(server, visitors, capfd,
                                                                                        disposition, refusal):
    marker = os.urandom(16).hex().encode()
    good = (b'--b0undary\r\nContent-Disposition: form-data; name="files"; filename="first.png"\r\n\r\n'
            + marker + b"-first\r\n")
    bad = b"--b0undary\r\nContent-Disposition: form-data; " + disposition.encode() + b"\r\n\r\n" + marker + b"\r\n"
    body = good + bad + b"--b0undary--\r\n"
    connection = raw_post(server.url, "gradio_api/upload", "127.0.0.44",
                          {"Content-Type": "multipart/form-data; boundary=b0undary",
                           "Content-Length": str(len(body))}, body)
    status, text = response_of(connection)
    assert status == 400 and refusal in text, (status, text)
    wait_until(lambda: not visitors.reserved, "the upload's reservation given back")
    assert not files_holding(marker)
    assert "Traceback" not in capfd.readouterr().err


def test_x_forwarded_for_is_trusted_only_by_the_guard_and_only_behind_its_proxies(server, visitors):
    visitor = Visitor(server.url, "127.0.0.1")  # the address uvicorn trusts by default
    response = visitor.http.post(server.url + "gradio_api/upload", headers={"X-Forwarded-For": "10.9.8.7"},
                                 files=[("files", ("photo.png", picture(45), "image/png"))])
    (path,) = response.json()
    assert visitors.uploads[path].client == "127.0.0.1"  # VLM_PROXY_HOPS=0: the socket's, not uvicorn's rewrite


def test_visitor_mistakes_are_one_named_line_without_a_traceback(server, capfd):
    visitor, example = Visitor(server.url, "127.0.0.46"), fn_index(server.demo, "accept_example")
    kind, error = visitor.page(example, [None], "mistakes-1", event_data={"index": 99, "value": {}})
    assert kind == "error" and "there is no example 99" in error, error
    for event_data in ({"index": 0}, None):
        kind, error = visitor.page(example, [None], "mistakes-2", event_data=event_data)
        assert kind == "refused" and "this event needs its event_data" in error, error
    kind, outputs = visitor.call("chat", chat_data("Hi", temperature=1.0, top_p=1e-300))
    assert kind == "complete" and outputs[1]["finish_reason"] == "max_new_tokens", outputs
    assert "Traceback" not in capfd.readouterr().err


# --- 5. every upload released exactly once --------------------------------------------------------------------

def files_holding(marker: bytes) -> list[str]:
    """Files anywhere under Gradio's upload folder that hold `marker`."""
    found = []
    for folder, _, names in os.walk(get_upload_folder()):
        for name in names:
            with contextlib.suppress(OSError), open(os.path.join(folder, name), "rb") as file:
                if marker in file.read():
                    found.append(os.path.join(folder, name))
    return found


def marked_picture(marker: str, seed: int) -> bytes:
    """A small PNG carrying `marker` as text (found on disk wherever Gradio puts it)."""
    info = PngImagePlugin.PngInfo()
    info.add_text("marker", marker)
    buffer = io.BytesIO()
    Image.new("RGB", (24, 16), (seed % 256, 80, 160)).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


class Actor:
    """A visitor who uploads, sends (from the page, or by the API), fails, undoes, stops and clears
    at random; its page conversation is `session_hash`."""

    def __init__(self, server, source: str, marker: str, rng: random.Random):
        self.server, self.rng, self.marker = server, rng, marker
        self.visitor, self.source, self.session_hash = Visitor(server.url, source), source, f"ledger-{source}"
        self.uploads: list[str] = []

    def upload(self) -> None:
        name = self.rng.choice(["photo.png", "note.txt", ".."])
        data = marked_picture(self.marker, self.rng.randrange(256)) if name != "note.txt" else \
            self.marker.encode() + b" is not an image"
        response = self.visitor.http.post(self.server.url + "gradio_api/upload",
                                          files=[("files", (name, data, "image/png"))])
        assert response.status_code == (400 if name == ".." else 200), response.text
        self.uploads += response.json() if response.status_code == 200 else []

    def message(self) -> dict:
        files = self.rng.sample(self.uploads, min(len(self.uploads), self.rng.randrange(3)))
        text = self.rng.choice(["Describe it."] * 3 + ["word " * 3000])  # the last is over the context: it fails
        return {"text": text, "files": [file_data(path) for path in files]}

    def act(self, action: str):
        demo, settings = self.server.demo, [SETTINGS[name] for name in SETTINGS]
        if action == "upload":
            return self.upload()
        if action in ("chat", "ab"):
            data = chat_data("", **{})
            data[0] = self.message()
            if action == "ab":
                data = [data[0], *[value for name, value in SETTINGS.items() if name != "mode"]]
            return self.visitor.call(action, data)
        if action == "clear":
            return self.visitor.call("clear", [None])
        if action == "send":
            kind, _ = self.visitor.page(fn_index(demo, "accept"), [self.message(), None], self.session_hash)
            return self.visitor.page(fn_index(demo, "respond"), [None, *settings], self.session_hash) \
                if kind == "complete" and self.rng.random() < 0.8 else kind  # else: the respond step never came
        if action == "stop":
            return self.visitor.http.post(self.server.url + "gradio_api/run/predict", json={
                "data": [None], "fn_index": fn_index(demo, "stop"), "session_hash": self.session_hash,
                "event_data": None, "trigger_id": None})
        return self.visitor.page(fn_index(demo, action), [None], self.session_hash)  # undo, new_conversation


ACTIONS = ["upload"] * 3 + ["send"] * 4 + ["chat", "ab", "clear", "stop", "undo", "undo", "new_conversation"]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_upload_is_released_once_whatever_the_visitors_do(server, visitors, monkeypatch, seed):
    rng, marker = random.Random(seed), f"ledger-{seed}-{os.urandom(6).hex()}"
    actors = [Actor(server, f"127.0.5{seed}.{i}", marker, rng) for i in (1, 2)]
    for actor in actors:
        actor.uploads += [actor.visitor.upload("first.png", marked_picture(marker, i)) for i in range(2)]
    for step in range(40):
        actor = rng.choice(actors)
        actor.act(rng.choice(ACTIONS))
    mine = lambda: {p: u for p, u in visitors.uploads.items() if u.client.startswith(f"127.0.5{seed}.")}  # noqa: E731
    # New chat on every page conversation: what only they held is gone; past the unsent time, the rest
    # is held by a conversation the API opened (one per call, live until it idles out).
    for actor in actors:
        actor.act("new_conversation")
    offset = [LIMITS.unsent_upload_s + 1]
    monkeypatch.setattr(visitors, "clock", lambda: time.perf_counter() + offset[0])
    visitors.sweep()
    pages = {visitors.known[actor.session_hash].session for actor in actors if actor.session_hash in visitors.known}
    assert all(upload.owners and not upload.owners & pages for upload in mine().values()), mine()
    # Past the idle time, every conversation ends: nothing is on disk, nothing counts against the addresses.
    offset[0] = LIMITS.idle_s + LIMITS.unsent_upload_s + 2
    visitors.sweep()
    assert not mine()
    assert not files_holding(marker.encode())
    for actor in actors:
        token, refusal = visitors.reserve(actor.source, LIMITS.upload_bytes_per_client)
        assert refusal is None, refusal  # the whole quota is free again
        visitors.unreserve(token)


def test_clear_while_an_answer_runs_releases_the_upload_the_answer_sent(server, visitors, tmp_path):
    sent = tmp_path / "running.png"
    sent.write_bytes(marked_picture("running", 7))
    client = Client(server.url, verbose=False)
    with Gate(server.engine.target.runner, at=2) as gate:
        job = client.submit(message("Describe the image.", [str(sent)]), mode="plain", max_new_tokens=40,
                            api_name="/chat")
        gate.wait()  # the answer runs, its upload claimed by the conversation
        (path,) = [p for p, upload in visitors.uploads.items() if upload.owners and p.endswith("running.png")]
        client.predict(api_name="/clear")
    job.result(timeout=120)
    wait_until(lambda: path not in visitors.uploads and not os.path.exists(path), "the cleared answer's upload deleted")
