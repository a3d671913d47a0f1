"""Each visitor's files are their own (issue 39, items 1, 2 and 8) and the examples are
read-only (issue 38, item 1), against the real app (`app.main` on the tiny Qwen2-VL target).
Visitors are raw HTTP clients that keep cookies, as a browser does and as gradio_client does
(it keeps those of its first `/config`), or gradio_client itself; addresses 127.0.0.x.

1. nothing is served that the visitor did not upload: not the upload journal, not another
   visitor's upload (which answers as a file that does not exist), not a folder;
2. every file a message names is one of the visitor's own uploads (or a bundled example),
   on every route, the page's handlers included, with the same refusal whether the file exists;
3. unsent uploads are their uploader's: another visitor cannot claim or delete one, and a path
   named twice in one message is one file;
4. the examples are served from their own folder: a visitor who uploads an example's bytes,
   sends them and starts a new chat leaves the example working for everyone.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import httpx
import pytest
from gradio.utils import get_upload_folder
from gradio_client import Client
from PIL import Image

from app_ui.components import EXAMPLES_DIR
from app_ui.visitors import Limits
from tests.helpers import app_fixture, launch_app, message
from tests.test_hostile import SETTINGS, file_data, fn_index

LIMITS = Limits(sessions_per_client=200, sweep_s=0.5)


server = app_fixture(limits=LIMITS)


@pytest.fixture(scope="module")
def visitors(server):
    """The app's Visitors: what it knows of each upload (the test reads it as a leak would tell it)."""
    return next(m.kwargs["visitors"] for m in server.demo.app.user_middleware if "visitors" in m.kwargs)


class Visitor:
    """One visitor: its own cookies (from `/config`, as gradio_client and the page get them, unless
    `cookies` is False), from its own address."""

    def __init__(self, url: str, source: str = "127.0.0.1", cookies: bool = True):
        self.url = url
        self.http = httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60)
        if cookies:
            self.http.get(url + "config").raise_for_status()

    def upload(self, name: str, data: bytes) -> str:
        response = self.http.post(self.url + "gradio_api/upload", files=[("files", (name, data, "image/png"))])
        assert response.status_code == 200, response.text
        return response.json()[0]

    def file(self, path: str, method: str = "GET") -> httpx.Response:
        return self.http.request(method, self.url + "gradio_api/file=" + path)

    def call(self, api: str, data: list) -> tuple[str, object]:
        """/gradio_api/call/<api>: ("complete", outputs), ("error", message) or ("refused", the Guard's)."""
        posted = self.http.post(self.url + f"gradio_api/call/{api}", json={"data": data})
        if posted.status_code != 200:
            return "refused", posted.json()["error"]
        stream = self.http.get(self.url + f"gradio_api/call/{api}/{posted.json()['event_id']}").text
        kind, payload = [line.split(": ", 1)[1] for line in stream.splitlines()
                         if line.startswith(("event:", "data:"))][-2:]
        return kind, json.loads(payload)

    def page(self, fn: int, data: list, session_hash: str, event_data=None) -> tuple[str, object]:
        """One of the page's handlers, by `fn_index`, as the browser calls it."""
        body = {"data": data, "fn_index": fn, "event_data": event_data, "session_hash": session_hash,
                "trigger_id": None}
        joined = self.http.post(self.url + "gradio_api/queue/join", json=body)
        if joined.status_code != 200:
            return "refused", joined.json().get("error", joined.text)
        event_id = joined.json()["event_id"]
        with self.http.stream("GET", self.url + "gradio_api/queue/data", params={"session_hash": session_hash}) as s:
            for line in s.iter_lines():
                event = json.loads(line[5:]) if line.startswith("data:") else {}
                if event.get("msg") == "process_completed" and event.get("event_id") == event_id:
                    output = event["output"]
                    return ("complete", output["data"]) if event["success"] else ("error", output.get("error"))
        return "lost", None


def picture(seed: int) -> bytes:
    """A small PNG, different for each seed."""
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (seed % 256, 90, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def chat(text: str, files: list) -> list:
    return [{"text": text, "files": files}, *SETTINGS.values()]


def inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


# --- 1. nothing served that the visitor did not upload ------------------------------------------------

def test_the_upload_journal_is_in_no_served_folder_and_never_served(server, visitors):
    owner = Visitor(server.url)
    path = owner.upload("mine.png", picture(1))
    journal = visitors.journal
    assert journal and path in open(journal).read()
    from gradio.data_classes import _StaticFiles
    served = [get_upload_folder(), EXAMPLES_DIR, *server.demo.allowed_paths, *map(str, _StaticFiles.all_paths)]
    assert not any(inside(journal, folder) for folder in served), (journal, served)
    old_place = os.path.join(get_upload_folder(), ".vlm-uploads", os.path.basename(journal))
    for visitor in (owner, Visitor(server.url, "127.0.0.2")):
        for target in (journal, old_place, get_upload_folder(), os.path.dirname(path), os.path.dirname(journal)):
            response = visitor.file(target)
            assert response.status_code in (403, 404) and path not in response.text, target
        for target in ("http://127.0.0.1:1/x.png", "//127.0.0.1:1/x.png", path + "%00", "/etc/passwd%00.png"):
            assert visitor.file(target).status_code == 404, target  # the server fetches nothing, fails on nothing


def test_an_upload_is_served_only_to_the_client_that_uploaded_it(server, visitors, tmp_path):
    data = picture(2)
    owner = Visitor(server.url)
    path = owner.upload("photo.png", data)
    assert owner.file(path).content == data and owner.file(path, "HEAD").status_code == 200
    nowhere = os.path.join(os.path.dirname(os.path.dirname(path)), "0" * 32, "photo.png")
    for other in (Visitor(server.url), Visitor(server.url, "127.0.0.3"), Visitor(server.url, cookies=False)):
        for method in ("GET", "HEAD"):
            theirs, missing = other.file(path, method), other.file(nowhere, method)
            assert theirs.status_code == missing.status_code == 404 and theirs.content == missing.content
    # The same bytes uploaded by another visitor are a file of its own, at a path of its own.
    other = Visitor(server.url)
    own = other.upload("photo.png", data)
    assert own != path and other.file(own).content == data and other.file(path).status_code == 404
    # gradio_client's uploads too: the path (if another visitor learnt it) answers only its client.
    client, sent = Client(server.url, verbose=False), tmp_path / "sent.png"
    sent.write_bytes(data)
    known = set(visitors.uploads)
    client.predict(message("Describe the image.", [str(sent)]), mode="plain", max_new_tokens=3, api_name="/chat")
    (stored,) = set(visitors.uploads) - known
    assert Visitor(server.url).file(stored).status_code == 404
    assert httpx.get(server.url + "gradio_api/file=" + stored, cookies=client.cookies).content == data


# --- 2. every file a message names is the visitor's own upload -----------------------------------------

ROUTES = ["chat", "ab", "accept", "ab_live"]


@pytest.fixture
def link():
    """A link in the upload folder to /etc/passwd (the test plants it: no visitor can)."""
    folder = os.path.join(get_upload_folder(), "planted-" + os.urandom(8).hex())
    os.makedirs(folder)
    os.symlink("/etc/passwd", os.path.join(folder, "link.png"))
    yield os.path.join(folder, "link.png")
    shutil.rmtree(folder)


@pytest.mark.parametrize("route", ROUTES)
def test_a_message_names_only_the_visitors_own_uploads_whether_or_not_a_file_exists(server, route, link):
    victim = Visitor(server.url, "127.0.0.4")
    theirs = victim.upload("private.png", picture(4))
    folder = os.path.dirname(os.path.dirname(theirs))
    entries = ["/etc/passwd", "/etc", "/no/such/file.png", {"name": "/etc/passwd"}, {"name": theirs},
               file_data(theirs), file_data(os.path.join(folder, "x", "..", *theirs.split(os.sep)[-2:])),
               file_data(link), file_data(folder + "/../../etc/passwd"), file_data("/no/such/file.png")]
    attacker = Visitor(server.url, "127.0.0.5")
    refusals = []
    for entry in entries:
        kind, refusal = _send(server, attacker, route, [entry], f"{route}-{len(refusals)}")
        assert kind == "refused", (entry, kind, refusal)
        shown = repr(entry if isinstance(entry, str) else entry.get("path", entry))[:80]
        assert shown in refusal, (shown, refusal)
        refusals.append(refusal.replace(shown, "FILE"))
    assert len(set(refusals)) == 1, refusals
    assert "is not a file you uploaded" in refusals[0]
    kind, outputs = _send(server, victim, route, [file_data(theirs)], f"{route}-own")
    assert kind == "complete", outputs


def _send(server, visitor: Visitor, route: str, files: list, session_hash: str) -> tuple[str, object]:
    if route in ("chat", "ab"):
        data = chat("Describe the image.", files)
        if route == "ab":
            data = [data[0], *[value for name, value in SETTINGS.items() if name != "mode"]]
        return visitor.call(route, data)
    box = {"text": "Describe the image.", "files": files}
    data = [box, None] if route == "accept" else [box, None, *[v for name, v in SETTINGS.items() if name != "mode"]]
    return visitor.page(fn_index(server.demo, route), data, session_hash)


# --- 3. unsent uploads are their uploader's -------------------------------------------------------------

def test_another_visitor_cannot_claim_or_delete_an_unsent_upload_and_a_path_twice_is_one_file(server, visitors):
    owner, other = Visitor(server.url), Visitor(server.url)  # one address, two browsers
    path = owner.upload("unsent.png", picture(6))
    kind, refusal = other.call("chat", chat("Describe the image.", [file_data(path), file_data(path)]))
    assert kind == "refused" and "is not a file you uploaded" in refusal
    assert other.call("clear", [])[0] == "complete"
    assert os.path.exists(path) and owner.file(path).status_code == 200
    # The owner names it twice (once through ".."): one file in the turn, held once, deleted by the
    # owner's New chat.
    accept, respond = fn_index(server.demo, "accept"), fn_index(server.demo, "respond")
    dotted = os.path.join(os.path.dirname(path), "..", *path.split(os.sep)[-2:])
    twice = {"text": "Describe the image.", "files": [file_data(path), file_data(dotted), file_data(path)]}
    assert owner.page(accept, [twice, None], "owner-twice")[0] == "complete"
    session = next(s for s in visitors.sessions.values() if s.pending is not None and path in s.files())
    assert session.pending.files == [path]
    assert owner.page(respond, [None, *SETTINGS.values()], "owner-twice")[0] == "complete"
    assert [turn.files for turn in session.turns] == [[path]]
    new_chat = fn_index(server.demo, "new_conversation")
    assert owner.page(new_chat, [None], "owner-twice")[0] == "complete"
    assert not os.path.exists(path)


# --- 4. the examples are read-only -------------------------------------------------------------------

def test_an_example_keeps_working_after_a_visitor_sends_its_bytes_and_starts_a_new_chat(server, visitors):
    examples = _chat_examples(server.url)
    urls = {url for example in examples for url in example}
    first = Visitor(server.url)
    assert all(first.http.get(_absolute(server.url, url)).status_code == 200 for url in urls)
    # Visitor A attaches the example's own file with the clip button, sends it, presses New chat.
    name = os.path.basename(examples[0][0].split("?")[0])
    data = open(os.path.join(EXAMPLES_DIR, name), "rb").read()
    path = first.upload(name, data)
    accept, respond = fn_index(server.demo, "accept"), fn_index(server.demo, "respond")
    box = {"text": "Describe this photo.", "files": [file_data(path)]}
    assert first.page(accept, [box, None], "example-a")[0] == "complete"
    assert first.page(respond, [None, *SETTINGS.values()], "example-a")[0] == "complete"
    new_chat = fn_index(server.demo, "new_conversation")
    assert first.page(new_chat, [None], "example-a")[0] == "complete"
    assert not os.path.exists(path)
    # Visitor B: every example's image still served, and the example answers.
    second = Visitor(server.url, "127.0.0.7")
    for url in urls:
        response = second.http.get(_absolute(server.url, url))
        assert response.status_code == 200, url
    assert second.http.get(_absolute(server.url, examples[0][0])).content == data
    example_select = fn_index(server.demo, "accept_example")
    assert second.page(example_select, [None], "example-b", event_data={"index": 0, "value": None})[0] == "complete"
    kind, outputs = second.page(respond, [None, *SETTINGS.values()], "example-b")
    assert kind == "complete", outputs
    assert "no such file" not in json.dumps(outputs) and "Cannot answer" not in json.dumps(outputs)
    # The A/B tab's examples put the example's own file in the box: the page's A/B handler takes it.
    kind, outputs = _send(server, second, "ab_live", [file_data(os.path.join(EXAMPLES_DIR, "chart.png"))], "example-ab")
    assert kind == "complete", outputs
    session = next(s for s in visitors.sessions.values() if s.turns and s.turns[-1].text == "Describe this photo."
                   and inside(s.turns[-1].files[0], EXAMPLES_DIR))
    assert session.turns[-1].answer


def _chat_examples(url: str) -> list[list[str]]:
    """The chat's examples as the page gets them: each example's image URLs."""
    config = httpx.get(url + "config").json()
    chatbot = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "chatbot")
    return [[file["url"] for file in example["files"]] for example in chatbot["props"]["examples"]]


def _absolute(base: str, url: str) -> str:
    return url if url.startswith("http") else base.rstrip("/") + url


# --- 5. at shutdown --------------------------------------------------------------------------------------

def test_uploads_and_the_journal_are_deleted_when_the_app_closes(zoo):
    served = launch_app(zoo, limits=LIMITS)
    visitors = next(m.kwargs["visitors"] for m in served.demo.app.user_middleware if "visitors" in m.kwargs)
    visitor = Visitor(served.url)
    paths = [visitor.upload(f"left{i}.png", picture(20 + i)) for i in range(2)]
    assert all(os.path.exists(path) for path in paths) and os.path.exists(visitors.journal)
    served.demo.close()
    assert not any(os.path.exists(path) or os.path.exists(os.path.dirname(path)) for path in paths)
    assert not os.path.exists(visitors.journal)
