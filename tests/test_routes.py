"""The public server's boundary (issue 57, issue 61 item 10), against the real app (`app.main` on
the tiny Qwen2-VL target), with raw HTTP as a hostile visitor sends it; addresses 127.0.0.x.

1. routes by name: every route Gradio's app registers is allowed or refused in
   app_ui/routes.py, and the refused ones (call/v2, run/ for a queued event, process_recording,
   ...) answer 404 before Gradio reads a byte;
2. the file check reads every file a request names, wherever it sits;
3. a check that cannot find what it checks refuses: Gradio's queue unreadable, a request without
   its queue or address, a claim without a visitor.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route

from app_ui import callbacks, queue_rules, routes
from app_ui.session import Session
from app_ui.visitors import MB, Limits, Visitors
from engine.engine import RequestError
from tests.helpers import app_fixture
from tests.test_hostile import SETTINGS, file_data, fn_index
from tests.test_privacy import Visitor, picture

LIMITS = Limits(idle_s=3600.0, unsent_upload_s=600.0, upload_bytes_per_client=20 * MB, sessions_per_client=40,
                sweep_s=3600.0)
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
