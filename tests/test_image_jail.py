"""Untrusted images are decoded in jailed children only (engine/image_jail.py, issue 57): the
issue's hostile files, built here byte by byte, are refused by name within the child's limits
(memory, time), the server's memory does not grow with them, the pool answers the next image
from a new child, a Stop ends a decode in progress, and an upload is never decoded in the
server's own process; an upload is decoded once (the check when it is attached and the send share
it, kept on its ledger entry). Then the same through the real app (`app.main`): one visitor's TIFF
bomb, another visitor's picture question answered; an API answer's images decoded before it takes
the answer slot, so that another address's answer goes first while they decode."""

from __future__ import annotations

import os
import pathlib
import re
import threading
import time

import numpy as np
import pytest
from PIL import Image

from gradio_client import Client

from app_ui import callbacks
from app_ui import uploads as uploads_module
from app_ui.served import Served
from app_ui.session import Session, Turn, new_turn, prepare_images
from app_ui.uploads import open_upload
from app_ui.visitors import Limits, Visitor, Visitors
from engine import images
from engine.image_jail import Decoding, ImageJail, Stopped
from tests.conftest import ROOT
from tests.helpers import launch_app, message, rss_bytes, wait_until
from measure.image_bombs import repeated_scan_jpeg, strip_tiff, zeros_png
from tests.test_hostile import api_call, chat_data, file_data, upload

MB = 1024 * 1024
RSS_BOUND = 40 * MB  # what the server may grow by while a child decodes a bomb (the bombs: +300 MB to +1.4 GB)


class LongestSide:
    """A processor's `size` as engine/images.py `fit_size` reads it (a remote server's: 1536 pixels)."""

    size = {"longest_edge": 1536}


def photo_png(tmp_path, name: str = "photo.png") -> str:
    path = tmp_path / name
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(path)
    return str(path)


def refused(jail: ImageJail, data: bytes, name: str, **options) -> tuple[str, float, int]:
    """(the refusal, the seconds it took, what the server's RSS grew by meanwhile)."""
    before, started = rss_bytes(), time.monotonic()
    with pytest.raises(images.ImageError) as refusal:
        jail.load(data, name=name, **options)
    return str(refusal.value), time.monotonic() - started, rss_bytes() - before


def test_a_strip_table_bomb_is_refused_at_the_childs_memory_limit_and_a_new_child_serves_the_next(tmp_path):
    jail = ImageJail(Decoding(decode_slots=1, decode_memory_mb=256, decode_seconds=15))
    try:
        first = jail.load(photo_png(tmp_path)).info["decoded_by"]
        refusal, seconds, grown = refused(jail, strip_tiff(1_000_000), "strips.tif")  # 5 MB; +330 MB in Pillow
        # Refused by Python's MemoryError, or at the deadline while allocating at the limit; or the child ended
        # on it (an allocation failing where Python cannot refuse): each names the memory limit. A child held
        # at its address-space limit may instead spend its CPU seconds there first (seen on a quiet 2-core
        # AMD EPYC): then the CPU limit is named. Either way the server's process stays small (below).
        assert re.match(r"strips.tif: (needed more than 256 MB to decode \(the server's limit for one image\)|"
                        r"the decoder ended on it \(.*256 MB|decoding took more than 15 s( of CPU time)? "
                        r"\(the server's limit for one image\))", refusal), refusal
        assert seconds < 15 + 5 and grown < RSS_BOUND, (seconds, grown)
        after = jail.load(photo_png(tmp_path))
        assert after.size == (400, 300) and after.info["decoded_by"] not in (first, os.getpid())
    finally:
        jail.close()


def test_a_repeated_scan_jpeg_is_cut_at_the_deadline_and_a_40_megapixel_row_comes_back_small(tmp_path):
    jail = ImageJail(Decoding(decode_slots=1, decode_seconds=1))
    try:
        refusal, seconds, grown = refused(jail, repeated_scan_jpeg(1024, 3000), "scans.jpg")
        assert re.match(r"scans.jpg: decoding took more than 1 s( of CPU time)? \(the server's limit for one image\)",
                        refusal), refusal
        assert seconds < 4 and grown < RSS_BOUND, (seconds, grown)
        assert jail.load(photo_png(tmp_path), fit=LongestSide()).size == (400, 300)
    finally:
        jail.close()
    jail = ImageJail(Decoding(decode_slots=1))
    try:
        before = rss_bytes()
        row = jail.load(zeros_png(40_000_000, 1), name="row.png", fit=LongestSide())  # 40 MB, 120 MB as RGB
        assert row.size == (1536, 1) and rss_bytes() - before < RSS_BOUND  # +533 MB in the server before
    finally:
        jail.close()


def test_a_shape_qwen_vl_refuses_is_refused_by_the_child_from_its_header_never_decoded_or_sent(tmp_path, zoo):
    """Qwen-VL's processor refuses an aspect ratio over 200:1 (smart_resize); a 40,000,000x1 PNG
    (120 MB as RGB) is refused by the child from its header, named with its ratio, and the same
    child serves the next image."""
    target = zoo.target("qwen2_vl")
    with pytest.raises(ValueError, match="aspect ratio"):  # the processor's own refusal, at 201:1
        target.processor.image_processor(images=[Image.new("RGB", (201 * 28, 28))])
    jail = ImageJail(Decoding(decode_slots=1))
    try:
        first = jail.load(photo_png(tmp_path), fit=target.processor, family=target.family).info["decoded_by"]
        refusal, _, grown = refused(jail, zeros_png(40_000_000, 1), "row.png", fit=target.processor,
                                    family=target.family)
        assert refusal == ("row.png: 40000000x1 is a shape this model's processor does not take (an aspect ratio "
                           "of 40,000,000:1, over the 200:1 it takes); send it cropped")
        assert grown < RSS_BOUND
        again = jail.load(photo_png(tmp_path), fit=target.processor, family=target.family)
        assert again.info["decoded_by"] == first != os.getpid()
    finally:
        jail.close()


def test_a_long_decode_leaves_its_slot_and_another_addresss_photo_does_not_wait_for_it(tmp_path):
    """One slot: a bomb past long_decode_s moves to the long lane; a second address's bomb, past it
    too while a third address's photo waits, is refused; the photo is decoded while the first bomb
    still runs (then stopped)."""
    jail = ImageJail(Decoding(decode_slots=1, decode_seconds=30, long_decode_s=0.5))
    results, stop_first = {}, threading.Event()

    def load(who: str, data: bytes, **options):
        try:
            results[who] = jail.load(data, name=f"{who}.jpg", client=who, **options).size
        except images.ImageError as error:
            results[who] = str(error)

    try:
        jail.warm()
        bomb = repeated_scan_jpeg(1024, 3000)
        first = threading.Thread(target=load, args=("first", bomb), kwargs={"cancelled": stop_first.is_set})
        first.start()
        wait_until(lambda: jail.long_busy == 1, "the first bomb in the long lane", timeout=30)
        second = threading.Thread(target=load, args=("second", bomb))
        second.start()
        wait_until(lambda: jail.busy == 1, "the second bomb in the slot", timeout=30)
        load("photo", pathlib.Path(photo_png(tmp_path)).read_bytes())
        assert results["photo"] == (400, 300) and "first" not in results  # the first bomb still decodes
        second.join(30)
        assert results["second"] == ("second.jpg: decoding takes over 0.5 s, and the server is decoding another "
                                     "such image now; send it again in a moment"), results
    finally:
        stop_first.set()
        first.join(30)
        jail.close()
    assert results["first"] == "first.jpg: not decoded: the answer was stopped"


def test_a_stop_ends_a_decode_in_progress_and_pillows_own_bound_holds_in_the_child(tmp_path):
    jail = ImageJail(Decoding(decode_slots=1, decode_seconds=60))
    stop = threading.Event()
    try:
        threading.Timer(0.5, stop.set).start()
        started = time.monotonic()
        with pytest.raises(Stopped, match="^scans.jpg: not decoded: the answer was stopped$"):
            jail.load(repeated_scan_jpeg(1024, 3000), name="scans.jpg", cancelled=stop.is_set)
        assert time.monotonic() - started < 3
        with pytest.raises(Stopped):  # stopped before its turn: no child is asked
            jail.load(photo_png(tmp_path), cancelled=lambda: True)
        with pytest.raises(images.ImageError, match=r"^bomb.png: far more than 40,000,000 pixels"):
            jail.load(zeros_png(9000, 9000), name="bomb.png")  # Pillow's check, set in the child: twice our cap
        assert Image.MAX_IMAGE_PIXELS != images.MAX_PIXELS  # ...and not here
    finally:
        jail.close()


def test_an_upload_is_decoded_in_a_child_never_in_the_server(tmp_path, monkeypatch):
    def in_the_server(*args, **kwargs):
        raise AssertionError("the server process decoded an upload")

    monkeypatch.setattr(images, "decode_file", in_the_server)  # the server's own copy: a child imports its own
    served = Served(backend=None, model="no model", jail=ImageJail(Decoding(decode_slots=1)))
    try:
        message = {"text": "What is this?", "files": [photo_png(tmp_path)]}
        turn = new_turn(message, served, Session())
        decoded_by = turn.images[0].info["decoded_by"]
        assert isinstance(decoded_by, int) and decoded_by != os.getpid()
        # A Stop since the request came ends its decodes; its time budget bounds them.
        session, arrived = Session(), time.perf_counter()
        session.request_stop()
        with pytest.raises(Stopped, match="^photo.png: not decoded: the answer was stopped$"):
            new_turn(message, served, session, arrived=arrived)
        session = Session()
        session.time_budget_s = 1e-6
        with pytest.raises(images.ImageError, match="^photo.png: not decoded: the answer's time budget ran out"):
            new_turn(message, served, session)
    finally:
        served.jail.close()


def uploaded(visitors: Visitors, tmp_path, names: list[str]) -> list[str]:
    """Photos put in `visitors`' ledger as the Guard records an upload (moved to private folders)."""
    token, refusal = visitors.reserve("127.0.0.1", 0)
    assert refusal is None
    paths, refusal = visitors.uploaded(token, [photo_png(tmp_path, name) for name in names])
    assert refusal is None
    return paths


def test_an_upload_is_decoded_once_for_its_check_and_its_send_and_forgotten_with_it(tmp_path):
    served = Served(backend=None, model="no model", jail=ImageJail(Decoding(decode_slots=1)))
    fitted = 300 * 400 * 3  # no processor: the photo's own size
    visitors = Visitors(Limits(decoded_bytes_per_client=2 * fitted))
    loads, load = [], served.jail.load
    served.jail.load = lambda path, **options: loads.append(os.path.basename(path)) or load(path, **options)
    try:
        first, second, third = uploaded(visitors, tmp_path, ["a.png", "b.png", "c.png"])
        # The page's check when it is attached, then the send's prepare step: one decode, the same pixels.
        assert callbacks.refused_files(served, {"files": [first]}, {}, ledger=visitors).__class__.__name__ == "dict"
        assert loads == ["a.png"]
        session, turn = Session(), Turn("What is this?", [first], [])
        prepare_images(served, session, turn, ledger=visitors)
        assert loads == ["a.png"] and turn.images[0] is visitors.decodes.kept[first][1].image
        # Two callers at once: one decodes, the other waits for it.
        pixels = []
        threads = [threading.Thread(target=lambda: pixels.append(open_upload(second, served.jail, visitors)))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert loads == ["a.png", "b.png"] and len(pixels) == 2 and pixels[0] is pixels[1]
        # Beyond the address's bound the least recently used goes (decoded again if it is sent); a
        # deleted upload takes its pixels with it.
        open_upload(third, served.jail, visitors)
        assert list(visitors.decodes.kept) == [second, third]
        assert visitors.claim(session, [second], Visitor("127.0.0.1")) is None
        visitors.release(session)
        assert second not in visitors.uploads and list(visitors.decodes.kept) == [third]
    finally:
        served.jail.close()


def test_no_app_module_decodes_a_file_itself():
    """Every upload goes through the jail: the app's modules call neither engine/images.py
    `load_image` nor `decode_file` on a path (only engine/image_jail.py's children do)."""
    modules = [*pathlib.Path(ROOT, "app_ui").glob("*.py"), *pathlib.Path(ROOT, "engine/backends").glob("*.py"),
               pathlib.Path(ROOT, "engine/__main__.py"), pathlib.Path(ROOT, "app.py")]
    assert len(modules) > 10
    callers = [str(path) for path in modules if re.search(r"\b(load_image|decode_file)\(", path.read_text())]
    assert not callers, callers


@pytest.fixture(scope="module")
def jailed_server(zoo):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLM_DECODE_MEMORY_MB", "256")
        patch.setenv("VLM_DECODE_SECONDS", "15")
        served = launch_app(zoo)
    yield served
    served.demo.close()


def test_a_tiff_bomb_sent_to_the_app_is_refused_and_another_visitor_gets_an_answer(jailed_server, tmp_path):
    url = jailed_server.url
    (bomb,) = upload(url, [("strips.tif", strip_tiff(1_000_000))], "127.0.57.1").json()
    (photo,) = upload(url, [("photo.png", pathlib.Path(photo_png(tmp_path)).read_bytes())], "127.0.57.2").json()
    results, before = {}, rss_bytes()

    def ask(who: str, path: str, source: str):
        results[who] = api_call(url, "chat", chat_data("What is this?", [file_data(path)]), source)

    attacker = threading.Thread(target=ask, args=("attacker", bomb, "127.0.57.1"))
    attacker.start()
    time.sleep(0.5)  # the bomb's decode has started
    ask("visitor", photo, "127.0.57.2")
    attacker.join(60)
    kind, error = results["attacker"]
    assert kind == "error" and error["error"].startswith("strips.tif: needed more than 256 MB to decode"), error
    kind, (answer, stats) = results["visitor"]
    assert kind == "complete" and stats["new_tokens"] >= 1, results["visitor"]
    assert rss_bytes() - before < 2 * RSS_BOUND


def test_an_api_answers_images_are_decoded_before_it_takes_the_slot(jailed_server, tmp_path, monkeypatch):
    """/chat through gradio_client with an image whose decode is held (a bomb's stand-in): the answer
    waits outside the answer slot meanwhile, so another address's /chat, sent after it, is answered
    while that decode is still held; released, the first is answered too."""
    held, release, returned = threading.Event(), threading.Event(), threading.Event()
    decode = uploads_module.open_upload

    def holding(path, **options):
        if os.path.basename(path) == "held.png":
            held.set()
            release.wait(60)  # bounded: a failed test must not hang the server
            returned.set()
        return decode(path, **options)

    monkeypatch.setattr(uploads_module, "open_upload", holding)  # uploads.decode_uploads: before its turn
    client = Client(jailed_server.url, verbose=False)
    try:
        job = client.submit(message("What is this?", [photo_png(tmp_path, "held.png")]), mode="plain",
                            max_new_tokens=3, api_name="/chat")
        wait_until(held.is_set, "the held image's decode")
        (photo,) = upload(jailed_server.url, [("photo.png", pathlib.Path(photo_png(tmp_path)).read_bytes())],
                          "127.0.57.4").json()
        kind, (answer, stats) = api_call(jailed_server.url, "chat", chat_data("What is this?", [file_data(photo)]),
                                         "127.0.57.4")
        assert kind == "complete" and stats["new_tokens"] >= 1
        assert not returned.is_set() and not job.done()  # answered while the other's decode was held
    finally:
        release.set()
    answer, stats = job.result(timeout=120)
    assert stats["new_tokens"] >= 1
