"""A public Space that survives hostile visitors (issue 24): each probe of the issue, sent to
the real app (`app.main` on the tiny Qwen2-VL target) as a visitor would send it, with
gradio_client or raw HTTP, the page's own handlers included (by `fn_index`, through
/gradio_api/queue/join, as the browser calls them). Addresses 127.0.0.x stand for visitors.

1. the page's send handler decodes images in the jail's children, under its slots, never all at once;
2. a burst of uploads cannot race the per-address bound; files are counted; the address is the
   proxy's hop, not the client's claim; uploads of an earlier process are swept;
3. one visitor's New chat never deletes another visitor's upload;
4. one address cannot push others' conversations out, and a dropped conversation is told so;
5. a request naming thousands of files is refused before Gradio touches any of them;
6. ceilings and a time budget bound a request; Stop takes a queued request out of the queue;
7. Retry at a seed out of range leaves the session usable;
8. visitor mistakes get named errors and no traceback; no server path in statistics;
   the monitoring route is off.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image

from app_ui.visitors import MB, Limits, Visitors
from engine import images
from engine.image_jail import Decoding, ImageJail
from engine.settings import Settings
from measure.image_bombs import zeros_png
from tests.conftest import ROOT
from tests.helpers import held_after_first_event, launch_app, message, wait_for_output, wait_until_queued

LIMITS = Limits(idle_s=30.0, unsent_upload_s=30.0, upload_bytes_per_client=20 * MB, upload_files_per_client=40,
                upload_bytes_total=200 * MB, sessions_per_client=6, sessions=24, time_budget_s=60.0, sweep_s=0.5)
# Every setting in the schema's order (engine/settings.py), as the page and the API send them.
SETTINGS = {**dataclasses.asdict(Settings()), "mode": "plain", "drafter": "text", "max_new_tokens": 3,
            "max_image_tokens": 0}


@pytest.fixture(scope="module")
def server(zoo):
    served = launch_app(zoo, limits=LIMITS)
    served.visitors = next(m.kwargs["visitors"] for m in served.demo.app.user_middleware if "visitors" in m.kwargs)
    yield served
    served.demo.close()


# --- raw HTTP, as a browser or a script sends it ---------------------------------------------------

def http(source: str, timeout: float = 60) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=timeout)


def upload(url: str, files: list[tuple[str, bytes]], source: str) -> httpx.Response:
    with http(source) as client:
        return client.post(url + "gradio_api/upload", files=[("files", (name, data, "image/png")) for name, data in files])


def file_data(path: str) -> dict:
    return {"path": path, "orig_name": os.path.basename(path), "meta": {"_type": "gradio.FileData"}}


def api_call(url: str, api: str, data: list, source: str) -> tuple[str, object]:
    """/gradio_api/call/<api> in a new session: ("complete", outputs), ("error", message) or
    ("refused", the Guard's message)."""
    with http(source) as client:
        posted = client.post(url + f"gradio_api/call/{api}", content=json.dumps({"data": data}),
                             headers={"content-type": "application/json"})
        if posted.status_code != 200:
            return "refused", posted.json()["error"]
        stream = client.get(url + f"gradio_api/call/{api}/{posted.json()['event_id']}").text
    kind, payload = [line.split(": ", 1)[1] for line in stream.splitlines() if line.startswith(("event:", "data:"))][-2:]
    return kind, json.loads(payload)


def chat_data(text: str, files: list = (), **changes) -> list:
    return [{"text": text, "files": list(files)}, *{**SETTINGS, **changes}.values()]


def page_call(url: str, fn: int, data: list, session_hash: str, source: str = "127.0.0.1") -> tuple[str, object]:
    """One event of the page, as the browser sends it: ("complete", outputs), ("error", message)
    or ("refused", the Guard's message)."""
    with http(source) as client:
        body = {"data": data, "fn_index": fn, "event_data": None, "session_hash": session_hash, "trigger_id": None}
        joined = client.post(url + "gradio_api/queue/join", content=json.dumps(body),  # NaN as a JSON token, as Python writes it
                             headers={"content-type": "application/json"})
        if joined.status_code != 200:
            return "refused", joined.json().get("error", joined.text)
        event_id = joined.json()["event_id"]
        with client.stream("GET", url + "gradio_api/queue/data", params={"session_hash": session_hash}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if event.get("msg") == "process_completed" and event.get("event_id") == event_id:
                        output = event["output"]
                        return ("complete", output["data"]) if event["success"] else ("error", output.get("error"))
    return "lost", None


def fn_index(demo, name: str) -> int:
    """The page's handler called `name` (the first, when several events run it)."""
    return next(i for i, fn in demo.fns.items() if getattr(fn.fn, "__name__", "") == name)


def float_tiff(folder, size: int, seed: int) -> bytes:
    """A float32 TIFF of size x size (4 bytes a pixel decoded), deflated: a few kB on disk."""
    values = np.zeros((size, size), np.float32)
    values[seed::7] = 0.5
    path = folder / f"float{seed}.tif"
    Image.fromarray(values, "F").save(path, compression="tiff_deflate")
    return path.read_bytes()


def ico(inner: bytes) -> bytes:
    """A Windows icon of one entry that says 256x256 and holds `inner` (a PNG of any size)."""
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(inner), 22) + inner


def icns(inner: bytes) -> bytes:
    """A Mac icon whose one entry, "ic10", says 1024x1024 and holds `inner`."""
    entry = b"ic10" + struct.pack(">I", 8 + len(inner)) + inner
    return b"icns" + struct.pack(">I", 8 + len(entry)) + entry


def flat_psd(width: int = 64, height: int = 64) -> bytes:
    """A Photoshop file without layers: header, empty mode / resource / layer sections, raw RGB."""
    header = b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, height, width, 8, 3)
    return header + struct.pack(">IIIH", 0, 0, 0, 0) + b"\x80" * (3 * width * height)


# Loads one file in a fresh interpreter: prints the refusal (or the size) and the peak memory it added.
LOAD_ONE = """
import resource, sys
from engine import images
data = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    print(images.load_image(data, name=sys.argv[1].rsplit("/", 1)[-1]).size)
except images.ImageError as error:
    print(error)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


# --- 1. images ----------------------------------------------------------------------------------------

def test_the_page_send_handler_decodes_images_under_the_decode_slots(server, tmp_path, monkeypatch):
    """Eight visitors send two float TIFFs each through the page's own send handlers at once:
    no more than the jail's slots (VLM_DECODE_SLOTS) decode at a time (each decode waits, up to
    half a second, for a third to start: without the slots, eight would)."""
    tiffs = [float_tiff(tmp_path, 1500, seed) for seed in range(4)]
    gate, decoding, peak = threading.Condition(), [0], [0]
    decode = ImageJail._decode

    def counted_decode(jail, *args):
        with gate:
            decoding[0] += 1
            peak[0] = max(peak[0], decoding[0])
            gate.notify_all()
            gate.wait_for(lambda: decoding[0] >= 3, timeout=0.5)
        try:
            return decode(jail, *args)
        finally:
            with gate:
                decoding[0] -= 1

    monkeypatch.setattr(ImageJail, "_decode", counted_decode)
    accept, respond, results = fn_index(server.demo, "accept"), fn_index(server.demo, "respond"), [None] * 8
    prepare = fn_index(server.demo, "prepare_images")
    settings = [SETTINGS[name] for name in SETTINGS]

    def visit(i: int):  # as the page sends: accept (checks only), prepare (opens the images), respond (answers)
        source = f"127.0.1.{i + 1}"
        paths = upload(server.url, [(f"v{i}-{k}.tif", tiffs[(i + k) % 4]) for k in range(2)], source).json()
        files = [file_data(p) for p in paths]
        accepted = page_call(server.url, accept, [{"text": "What is this?", "files": files}, None], f"decode-{i}", source)
        prepared = accepted if accepted[0] != "complete" else \
            page_call(server.url, prepare, [None], f"decode-{i}", source)
        results[i] = prepared if prepared[0] != "complete" else \
            page_call(server.url, respond, [None, *settings], f"decode-{i}", source)

    threads = [threading.Thread(target=visit, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(result and result[0] == "complete" for result in results), results
    assert 1 <= peak[0] <= Decoding().slots() <= 2, peak[0]  # VLM_DECODE_SLOTS


def test_an_image_is_refused_from_its_header_by_its_decoded_size_and_reduced_as_it_is_decoded(tmp_path, zoo):
    path = tmp_path / "float.tif"
    path.write_bytes(float_tiff(tmp_path, 1000, 0))
    with pytest.raises(images.ImageError, match=r"float.tif: 1000x1000 in mode F is 4 MB decoded, over the limit "
                                                r"of 3 MB"):
        images.load_image(str(path), max_decoded_bytes=3_000_000)
    target = zoo.target("qwen2_vl")
    processor, family = target.processor, target.family
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (3000, 4000, 3), dtype=np.uint8))
    photo.save(tmp_path / "photo.jpg", quality=90)
    fitted = images.load_image(str(tmp_path / "photo.jpg"), fit=processor, family=family)
    assert fitted.size == images.fit_to_processor(photo, processor, family).size == (84, 56)
    exif = Image.Exif()
    exif[0x0112] = 6  # turned a quarter: the processor sees it upright, 56x84
    photo.save(tmp_path / "turned.jpg", quality=90, exif=exif)
    assert images.load_image(str(tmp_path / "turned.jpg"), fit=processor, family=family).size == (56, 84)


@pytest.mark.parametrize("name,build", [
    ("icon.ico", lambda: ico(zeros_png(13000, 13000))),  # the issue's: 169 MB decoded inside Image.open
    ("small.ico", lambda: ico(zeros_png(6000, 6000))),  # under the pixel cap: decoded, then answered
    ("icon.icns", lambda: icns(zeros_png(13000, 13000))),  # decoded at a size its header does not say
    ("flat.psd", flat_psd),  # EOFError from seek(0), with a traceback
])
def test_icons_and_other_formats_are_refused_by_name_before_any_decoder_runs(tmp_path, name, build):
    path = tmp_path / name
    path.write_bytes(build())
    run = subprocess.run([sys.executable, "-c", LOAD_ONE, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    refusal, added = run.stdout.splitlines()
    kind = {"ico": "ICO (Windows Icon)", "icns": "ICNS (Mac OS icns resource)", "psd": "PSD (Adobe Photoshop)"}
    assert refusal == (f"{name}: {kind[name.rsplit('.', 1)[1]]} is an image format this app does not read (PNG, "
                       "JPEG, WebP, GIF, BMP and TIFF work); convert it"), run.stdout + run.stderr
    assert int(added) < 16 * MB, added  # nothing decoded (the 13000x13000 entry: +164 MB before)
    assert "Traceback" not in run.stderr and "warn" not in run.stderr.lower(), run.stderr


def test_every_decoder_failure_is_one_named_line_and_memory_is_trimmed_after_refusals(monkeypatch):
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8))
    trims = []
    monkeypatch.setattr(images, "_return_freed_memory", lambda: trims.append(1))
    for format in images.FORMATS:
        whole = io_bytes(photo, format)
        for cut in (12, 40, len(whole) // 2):
            name = f"cut{cut}.{format.lower()}"
            with pytest.raises(images.ImageError) as refused:
                images.load_image(whole[:cut], name=name)
            assert str(refused.value).startswith(f"{name}: ") and "\n" not in str(refused.value), refused.value
        trims.clear()
        images.load_image(whole, name=f"whole.{format.lower()}")  # and the whole file is read
        assert trims, format
    trims.clear()
    with pytest.raises(images.ImageError, match="over the limit of 40,000,000"):
        images.load_image(zeros_png(7000, 7000), name="bomb.png")  # refused from the header...
    assert trims  # ...and what opening it allocated handed back
    # The server process keeps Pillow's own bomb check as Pillow sets it (the jail's children set theirs).
    assert Image.MAX_IMAGE_PIXELS == int(1024 * 1024 * 1024 // 4 // 3)


def io_bytes(image: Image.Image, format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format)
    return buffer.getvalue()


def test_an_icon_or_a_photoshop_file_sent_to_the_app_is_refused_by_name(server, capfd):
    paths = upload(server.url, [("icon.ico", ico(zeros_png(6000, 6000))), ("flat.psd", flat_psd())],
                   "127.0.9.1").json()
    for path, refusal in zip(paths, ["icon.ico: ICO (Windows Icon) is an image format", "flat.psd: PSD (Adobe"]):
        kind, error = api_call(server.url, "chat", chat_data("What is this?", [file_data(path)]), "127.0.9.1")
        assert kind == "error" and error["error"].startswith(refusal), (kind, error)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


# --- 2. uploads ---------------------------------------------------------------------------------------

def test_a_burst_of_uploads_cannot_race_the_bound_and_files_are_counted(server):
    start, codes = threading.Barrier(12), [0] * 12

    def send(i: int):
        data = os.urandom(5 * MB)
        start.wait()
        codes[i] = upload(server.url, [(f"burst{i}.png", data)], "127.0.2.1").status_code

    threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert codes.count(200) * 5 * MB <= LIMITS.upload_bytes_per_client and codes.count(429) >= 8, codes
    # Many tiny files: counted one by one (each takes a folder and a block on disk).
    tiny = [(f"t{i}.png", os.urandom(16)) for i in range(LIMITS.upload_files_per_client + 1)]
    refused = upload(server.url, tiny, "127.0.2.2")
    assert refused.status_code == 429 and "would take your address over 40 uploaded files" in refused.text
    assert upload(server.url, tiny[:5], "127.0.2.2").status_code == 200


def test_the_address_is_the_proxy_hop_and_an_earlier_process_uploads_are_swept(tmp_path):
    from app_ui.guard import Guard
    from app_ui.journals import sweep_journals

    guard = Guard(None, Visitors(Limits(proxy_hops=1)))
    spoofed = {b"x-forwarded-for": b"6.6.6.6, 203.0.113.7"}  # the client wrote 6.6.6.6; the proxy appended its peer
    assert guard.client({"client": ("10.16.3.80", 1)}, spoofed) == "203.0.113.7"
    assert Guard(None, Visitors(Limits())).client({"client": ("10.16.3.80", 1)}, spoofed) == "10.16.3.80"
    left = tmp_path / "abc" / "left.png"
    left.parent.mkdir()
    left.write_bytes(b"x")
    journals = tmp_path / "journals"
    journals.mkdir()
    (journals / "999999999-7860.txt").write_text(f"{left}\n")  # a process that is gone
    (journals / f"{os.getpid()}-7861.txt").write_text("")  # this one: kept
    assert sweep_journals(str(journals)) == 1 and not left.parent.exists()
    assert sorted(os.listdir(journals)) == [f"{os.getpid()}-7861.txt"]


# --- 3. ownership ------------------------------------------------------------------------------------

def test_a_new_chat_never_deletes_an_upload_another_visitor_has_not_sent(server, tmp_path):
    picture = tmp_path / "shared.png"
    Image.new("RGB", (40, 30), (10, 200, 30)).save(picture)
    (b_path,) = upload(server.url, [("shared.png", picture.read_bytes())], "127.0.3.2").json()
    a = Client(server.url, verbose=False)
    a.predict(message("Describe the image.", [str(picture)]), mode="plain", max_new_tokens=3, api_name="/chat")
    a.predict(api_name="/clear")  # A's New chat: the same bytes, the same path as B's unsent upload
    assert os.path.exists(b_path)
    kind, outputs = api_call(server.url, "chat", chat_data("Describe the image.", [file_data(b_path)]), "127.0.3.2")
    assert kind == "complete", outputs


# --- 4. sessions -------------------------------------------------------------------------------------

def test_one_address_cannot_open_sessions_without_bound_and_a_dropped_conversation_is_told(server):
    # Past the bound, the address's own oldest idle session makes room (tests/test_server_limits.py).
    answers = [api_call(server.url, "clear", [], "127.0.4.1")[0] for _ in range(LIMITS.sessions_per_client + 1)]
    assert answers == ["complete"] * (LIMITS.sessions_per_client + 1)
    assert sum(known.client == "127.0.4.1" for known in server.visitors.known.values()) == LIMITS.sessions_per_client
    # Many addresses together can still fill Gradio's store (LIMITS.sessions): a conversation it
    # dropped is told so once, then starts again.
    visitor = Client(server.url, verbose=False)
    visitor.predict(message("Hi"), mode="plain", max_new_tokens=3, api_name="/chat")
    for address in range(LIMITS.sessions // LIMITS.sessions_per_client + 1):
        for _ in range(LIMITS.sessions_per_client):
            assert api_call(server.url, "clear", [], f"127.0.4.{10 + address}")[0] == "complete"
    with pytest.raises(AppError, match="the server dropped this conversation to make room for others"):
        visitor.predict(message("And now?"), mode="plain", max_new_tokens=3, api_name="/chat")
    answer, stats = visitor.predict(message("And now?"), mode="plain", max_new_tokens=3, api_name="/chat")
    assert stats["new_tokens"] == 3


# --- 5. cheap checks first ---------------------------------------------------------------------------

def test_a_request_naming_thousands_of_files_is_refused_before_gradio_opens_any(server, monkeypatch):
    import gradio.processing_utils

    checked = []
    check_allowed = gradio.processing_utils._check_allowed
    monkeypatch.setattr(gradio.processing_utils, "_check_allowed",
                        lambda path, *args: checked.append(path) or check_allowed(path, *args))
    files = [file_data(f"/tmp/gradio/x{i}/a.png") for i in range(3000)]
    kind, refusal = api_call(server.url, "chat", chat_data("Hi", files), "127.0.5.1")
    assert kind == "refused" and refusal == "the request names over 64 files; the limit is 64 images a message"
    kind, refusal = page_call(server.url, fn_index(server.demo, "accept"), [{"text": "Hi", "files": files}, None],
                              "many-files", "127.0.5.2")
    assert kind == "refused" and "names over 64 files" in refusal
    assert checked == []


# --- 6. request budget, stop ------------------------------------------------------------------------

@pytest.mark.parametrize("changes,refusal", [
    # Outside the schema's ranges (engine/settings.py), then over this server's own ceilings (VLM_MAX_*).
    (dict(max_new_tokens=10**9), r"max_new_tokens must be from 1 to 4096, got 1000000000"),
    (dict(draft_tokens=64), r"draft_tokens must be from 0 to 16 on this server \(VLM_MAX_DRAFT_TOKENS\)"),
    (dict(draft_tree=-3), r"draft_tree must be from 0 \(chains\) to 64, got -3"),
    (dict(draft_tree=10**9), r"draft_tree must be from 0 \(chains\) to 64, got 1000000000"),
    (dict(draft_tree=40), r"draft_tree must be from 0 to 32 on this server \(VLM_MAX_DRAFT_TREE\)"),
    (dict(temperature=float("inf")), r"the request holds Infinity, which is not a number JSON carries"),
])
def test_request_settings_over_the_ceilings_get_named_errors(server, changes, refusal):
    kind, error = api_call(server.url, "chat", chat_data("Hi", mode="speculative", **changes), "127.0.6.1")
    assert re.search(refusal, error["error"] if kind == "error" else error), (changes, kind, error)


def test_whole_numbers_past_any_bound_are_refused_by_name_and_a_bare_string_is_the_text(server, capfd):
    """Every integer setting has a bound that JSON encoders and servers take (2**64 was answered and
    then the statistics could not be sent: `error: None`); a float setting sent as a whole number
    over 1e308 is named too; a message sent as a string is its text (docs/app.md)."""
    client = Client(server.url, verbose=False)
    text_only = {"text": "Hi", "files": []}
    for changes, refusal in [
        (dict(max_image_tokens=2**64), r"max_image_tokens must be from 0 \(the model's own limit\) to 2\*\*20, got "
                                       r"18446744073709551616"),
        (dict(top_k=2**64), r"top_k must be from 0 \(off\) to 2\*\*20, got 18446744073709551616"),
        (dict(temperature=10**400), r"temperature must be a finite number, got a 1,329-bit number"),
        (dict(seed=-10**400), r"seed must be from 0 to 2\*\*63 - 1, got a 1,329-bit number"),
    ]:
        with pytest.raises(AppError, match=refusal):
            client.predict(text_only, mode="plain", max_new_tokens=3, api_name="/chat", **changes)
    answer, stats = client.predict("Hi", mode="plain", max_new_tokens=3, max_image_tokens=2**20, api_name="/chat")
    client.predict(api_name="/clear")
    assert answer == client.predict(text_only, mode="plain", max_new_tokens=3, api_name="/chat")[0]
    assert stats["max_image_tokens"] == 2**20 and stats["new_tokens"] == 3
    plain, speculative, *_ = client.predict("Hi", max_new_tokens=3, api_name="/ab")
    assert plain == speculative == answer
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


@pytest.fixture
def held(server, monkeypatch):
    """Answers to a message containing "HOLD" stop after their first chunk until `release` is set
    or their stop flag is (Stop, or the time budget)."""
    release, steps = threading.Event(), server.engine._steps

    def holding(messages, *args, stop=None, **kwargs):  # Engine._steps, its first event held
        text = json.dumps([part.get("text", "") for m in getattr(messages, "messages", messages)
                           for part in m["content"] if part["type"] == "text"])
        def hold():
            while "HOLD" in text and not (release.is_set() or (stop is not None and stop.is_set())):
                release.wait(0.05)

        return held_after_first_event(steps(messages, *args, stop=stop, **kwargs), hold)

    monkeypatch.setattr(server.engine, "_steps", holding)
    yield release
    release.set()


def test_an_answer_ends_at_the_time_budget_and_says_so(server, held, monkeypatch):
    monkeypatch.setattr(server.visitors, "limits", dataclasses.replace(LIMITS, time_budget_s=1.0))
    answer, stats = Client(server.url, verbose=False).predict(message("HOLD, then tell me."), mode="plain",
                                                              max_new_tokens=50, api_name="/chat")
    assert stats["finish_reason"] == "time_budget" and 1 <= stats["new_tokens"] < 50, stats


def test_an_ab_may_take_two_answers_time_and_a_cut_says_so(server, held, monkeypatch):
    monkeypatch.setattr(server.visitors, "limits", dataclasses.replace(LIMITS, time_budget_s=1.0))
    data = [{"text": "HOLD, then tell me.", "files": []}, None, *[v for name, v in SETTINGS.items() if name != "mode"]]
    started = time.perf_counter()
    kind, outputs = page_call(server.url, fn_index(server.demo, "ab_live"), data, "ab-budget")
    assert kind == "complete", outputs
    verdict, _, _, table = outputs
    assert "Cut at the server's time budget" in verdict and "cut at the server's time budget" in str(table), outputs
    assert time.perf_counter() - started >= 2.0  # the budget of two answers: the plain side was held past one


def test_a_stopped_request_leaves_the_queue_at_once(server, held):
    running, waiting = Client(server.url, verbose=False), Client(server.url, verbose=False)
    long_job = running.submit(message("HOLD this one."), mode="plain", max_new_tokens=20, api_name="/chat")
    wait_for_output(long_job)
    queued = waiting.submit(message("Describe the image."), mode="plain", max_new_tokens=20, api_name="/chat")
    wait_until_queued(queued)
    waiting.predict(api_name="/stop")
    answer, stats = queued.result(timeout=20)  # while the answer ahead of it is still held
    assert answer == "" and stats["finish_reason"] == "stopped" and not long_job.done()
    held.set()
    assert long_job.result(timeout=60)[1]["finish_reason"] in ("max_new_tokens", "stop_token")


# --- 7. seeds ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("i,seed", enumerate([2**64, 2**63 - 1, float("nan")]))
def test_retry_at_any_seed_leaves_the_session_usable(server, i, seed):
    demo, session, source = server.demo, f"retry-{seed}", f"127.0.7.{i + 1}"
    settings = [SETTINGS[name] for name in SETTINGS]
    accept, respond, retry = (fn_index(demo, name) for name in ("accept", "respond", "retry"))
    assert page_call(server.url, accept, [{"text": "Hi", "files": []}, None], session, source)[0] == "complete"
    assert page_call(server.url, respond, [None, *settings], session, source)[0] == "complete"
    kind, outputs = page_call(server.url, retry, [None, 1.0, seed], session, source)
    if seed != seed:  # NaN: refused at the door, by name
        assert kind == "refused" and outputs == "the request holds NaN, which is not a number JSON carries: send " \
                                                "finite numbers"
    else:
        assert kind == "complete", outputs
    if seed == 2**63 - 1:
        assert outputs[1] == 0  # wraps to 0: 2**63 is no seed
    assert page_call(server.url, respond, [None, *settings], session, source)[0] == "complete"
    kind, outputs = page_call(server.url, accept, [{"text": "Again", "files": []}, None], session, source)
    assert kind == "complete", outputs  # not "an answer is still streaming"


# --- 8. named mistakes ---------------------------------------------------------------------------------

def test_visitor_mistakes_are_named_without_tracebacks_and_statistics_hold_no_path(server, capfd):
    cases = [
        ([{"text": "Hi", "files": "abc"}], "refused", "message 'files' must be a list of files, got str"),
        ([{"text": "Hi", "files": [{"path": 5, "meta": {"_type": "gradio.FileData"}}]}], "refused",
         "message 'files': 5 is not a file you uploaded to this server"),
        ([{"text": "Hi", "files": [file_data("/etc/hostname")]}], "refused",
         "message 'files': '/etc/hostname' is not a file you uploaded to this server"),
        ([{"text": "Hi", "files": [file_data(server.url + "gradio_api/startup-events")]}], "refused",
         "is a URL; this server takes only files uploaded to it"),
    ]
    for data, expected_kind, expected in cases:
        kind, error = api_call(server.url, "chat", data + chat_data("")[1:], "127.0.8.1")
        assert kind == expected_kind and expected in str(error), (data, kind, error)
    kind, error = page_call(server.url, fn_index(server.demo, "accept"), [{"text": "Hi", "files": "abc"}, None],
                            "mistakes", "127.0.8.3")  # the page's own send handler
    assert kind == "refused" and error == "message 'files' must be a list of files, got str"
    kind, (answer, stats) = api_call(server.url, "chat", chat_data("Hi", mode="speculative"), "127.0.8.2")
    assert stats["drafter"] == "text"
    response = httpx.get(server.url + "monitoring")
    assert response.status_code == 404
    out, err = capfd.readouterr()
    assert "Traceback" not in err + out and "onitoring URL" not in out
