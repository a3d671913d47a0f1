"""Reliability and security through the real Gradio server, driven with gradio_client.

One app serves the whole module (the tiny Qwen2-VL target with its text drafter and n-gram,
float32, greedy), launched without --host as a user would. Every answer is checked against the
same conversation answered alone by a separate engine over the same weights (`reference`):
equal text, so nothing was lost, mixed up or leaked between requests.

- bad inputs: each is refused with a message naming the file or the limit, the server keeps
  serving, and the conversation goes on as if the bad turn had never been sent;
- odd but valid images (animated, CMYK, 16-bit, palette, RGBA, EXIF-rotated, no text) are
  answered; the image the model received is checked pixel by pixel;
- 8 clients at once, 20 stops at random passes (each answer held at a gate, tests/helpers.py),
  a soak that must not grow the live tensors and images (200 requests here; `pytest -m slow`
  runs the full one);
- faults: a drafter that raises (the answer completes plainly), out of memory in the target
  (the request ends with a message, the engine recovers);
- models that fail to load say why and which flag fixes it; remote code and pickled weights
  never run;
- binding, sharing, Gradio's file routes, and secrets in logs.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import pickle
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

import app
from app_ui import callbacks, setup
from app_ui.session import Options, Session, new_turn
from app_ui.visitors import Limits
from engine.__main__ import main as cli_main
from engine.images import MAX_FILE_BYTES, load_image
from engine.loop import DecodeSettings
from models import tiny
from tests.conftest import ROOT
from tests.helpers import Gate, app_fixture, live_objects, message, reference, rss_bytes

EXAMPLE = f"{ROOT}/assets/examples/chart.png"
SHORT = 3  # max_new_tokens of the turns that only show the server still answers
LONG = 400  # max_new_tokens of a stopped answer: "Describe the image." never ends early, and
MAX_STOP_PASS = 30  # 30 passes of at most 9 tokens never reach it
SOAK_REQUESTS = 200
FULL_SOAK_REQUESTS = 2000
# The soak's checks: the count of live tensors and images must not grow at all (a KV cache or an
# image kept per request adds hundreds); RSS, which depends on the allocator, gets a loose bound
# that only a leak of whole caches per request breaks over the full soak.
RSS_SLACK_BYTES = 64 * 2**20
RSS_PER_REQUEST_BYTES = 40 * 2**10


# The app as `python app.py --model M --drafter D --no-browser` starts it (no --host, no --share, no
# related environment variables), and the engine it built, for gates and faults.
server = app_fixture(limits=Limits(answers_per_client=8))  # 8 clients at once, all from 127.0.0.1


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Eight small distinct PNGs."""
    folder = tmp_path_factory.mktemp("pictures")
    paths = []
    for i, image in enumerate(tiny.tiny_images(8, seed=3)):
        paths.append(str(folder / f"picture{i}.png"))
        image.save(paths[-1])
    return paths


def save(image: Image.Image, path, **options) -> str:
    image.save(path, **options)
    return str(path)


def bad_files(folder) -> dict[str, tuple[str, str]]:
    """Files that are not usable images: name -> (path, the refusal it must get)."""
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8))
    png, jpeg = io.BytesIO(), io.BytesIO()
    noise.save(png, "PNG")
    noise.save(jpeg, "JPEG")
    corrupt = bytearray(png.getvalue())
    corrupt[12:16] = b"XXXX"  # the IHDR chunk's type
    contents = {
        "notes.txt": b"hello, not an image",
        "report.pdf": b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF",
        "drawing.svg": b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>',
        "corrupt.png": bytes(corrupt),
        "empty.png": b"",
        "truncated.png": png.getvalue()[: len(png.getvalue()) // 2],
        "truncated.jpg": jpeg.getvalue()[:600],
    }
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    # Decompression bombs: a one-colour 1-bit PNG compresses to kilobytes. 7000x7000 is over our
    # limit but under Pillow's; 20000x20000 (400 MB decoded, 50 kB on disk) trips Pillow's own check.
    Image.new("1", (7000, 7000)).save(folder / "bomb.png", optimize=True)
    Image.new("1", (20000, 20000)).save(folder / "huge_bomb.png", optimize=True)
    refusals = {name: ": not an image file" for name in ("notes.txt", "report.pdf", "drawing.svg", "corrupt.png")}
    refusals.update({
        "empty.png": ": the file is empty",
        "truncated.png": ": damaged or truncated",
        "truncated.jpg": ": damaged or truncated",
        "bomb.png": r": 7000x7000 is 49,000,000 pixels, over the limit of 40,000,000 .*decompression bomb",
        "huge_bomb.png": r": far more than 40,000,000 pixels .*decompression bomb",
    })
    return {name: (str(folder / name), re.escape(name) + refusal) for name, refusal in refusals.items()}


def bad_inputs(folder, pictures) -> list[tuple[str, dict, str]]:
    """(what, message, the refusal it must get): everything a user or script may send that
    cannot be answered."""
    cases = [(name, message("What is this?", [path]), refusal) for name, (path, refusal) in bad_files(folder).items()]
    strip = save(Image.new("RGB", (4000, 10), (0, 90, 200)), folder / "strip.png")
    return cases + [
        ("aspect ratio 400:1", message("What is this?", [strip]),
         r"strip\.png: 4000x10 is a shape this model's processor does not take \(an aspect ratio of 400:1"),
        ("9 images", message("Compare them.", pictures + pictures[:1]), r"9 images .*limit is 8 images"),
        ("a good image among bad ones", message("Both?", [pictures[0], f"{folder}/notes.txt"]),
         r"notes\.txt: not an image file"),
        ("blank message", message("   "), "the message is empty"),
        ("empty message", {"text": "", "files": []}, "the message is empty"),
        ("unknown mode", message("Hi"), "sideways.* is not in the list of choices"),  # Gradio checks it
    ]


def test_bad_inputs_are_refused_with_a_reason_and_the_conversation_goes_on(server, engine, pictures, tmp_path):
    client = Client(server.url, verbose=False)
    # 1. A first turn with images, so that "the conversation is kept" means something.
    turns = [("Describe each image.", pictures[:2])]
    answers = [client.predict(message(*turns[0]), max_new_tokens=SHORT, api_name="/chat")[0]]
    cases = bad_inputs(tmp_path, pictures)
    for i, (what, bad, refusal) in enumerate(cases):
        # 2. The bad input is refused with a message that names the file or the limit...
        mode = "sideways" if what == "unknown mode" else "speculative"
        with pytest.raises(AppError, match=refusal):
            client.predict(bad, mode=mode, max_new_tokens=SHORT, api_name="/chat")
        # 3. ...and a normal turn right after it is answered, in the same conversation.
        turns.append((f"And now {i}?", [pictures[i % 8]] if i % 3 == 0 else []))
        answers.append(client.predict(message(*turns[-1]), max_new_tokens=SHORT, api_name="/chat")[0])
    # 4. Every answer is the one the conversation of good turns alone gets: no bad turn was kept.
    for n in range(len(turns)):
        history = [(text, paths, answers[i]) for i, (text, paths) in enumerate(turns[:n])]
        assert answers[n] == reference(engine, history + [(*turns[n], None)], max_new_tokens=SHORT).text, n
    assert len(cases) >= 15


def test_the_command_line_refuses_bad_images_with_one_line(zoo, tmp_path, capsys):
    for name, (path, refusal) in bad_files(tmp_path).items():
        assert cli_main(["--model", str(zoo.dir("qwen2_vl")), "--image", path, "What is this?"]) == 2, name
        error = capsys.readouterr().err
        assert re.fullmatch("error: " + refusal + ".*\n", error), error


def odd_images(folder) -> dict:
    """Valid images in unusual encodings, each with a check of the RGB image the model gets."""
    red, blue = (255, 0, 0), (0, 0, 255)
    stored = Image.new("RGB", (96, 64), red)  # left half red, right half blue, shown rotated
    stored.paste(blue, (48, 0, 96, 64))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    frames = [Image.new("RGB", (40, 40), colour) for colour in (red, blue)]
    gradient = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (32, 1))
    palette = Image.new("P", (32, 32), 0)
    palette.putpalette([255, 0, 0, 0, 200, 0] + [0] * 762)
    palette.paste(1, (16, 0, 32, 32))
    rgba = Image.new("RGBA", (32, 32), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (16, 0, 32, 32))

    def near(pixel, colour):
        return max(abs(a - b) for a, b in zip(pixel, colour)) <= 8

    return {  # name: (path, check of the processed image)
        "EXIF-rotated JPEG": (save(stored, folder / "rotated.jpg", exif=exif, quality=95),
                              lambda im: im.size == (64, 96) and near(im.getpixel((32, 10)), red)
                              and near(im.getpixel((32, 85)), blue)),
        "animated GIF": (save(frames[0], folder / "animated.gif", save_all=True, append_images=frames[1:],
                              duration=100, loop=0), lambda im: im.getpixel((5, 5)) == red),
        "CMYK JPEG": (save(Image.new("CMYK", (48, 48), (255, 0, 0, 0)), folder / "cmyk.jpg"),
                      lambda im: near(im.getpixel((5, 5)), (0, 255, 255))),
        "16-bit PNG": (save(Image.fromarray(gradient), folder / "sixteen.png"),
                       lambda im: im.getpixel((0, 0)) == (0, 0, 0) and im.getpixel((63, 0)) == (255, 255, 255)),
        "palette PNG, transparent": (save(palette, folder / "palette.png", transparency=0),
                                     lambda im: im.getpixel((2, 2)) == (255, 255, 255)
                                     and im.getpixel((20, 2)) == (0, 200, 0)),
        "RGBA PNG": (save(rgba, folder / "rgba.png"),
                     lambda im: im.getpixel((2, 2)) == (255, 255, 255) and im.getpixel((20, 2)) == blue),
    }


def test_odd_images_are_handled_and_the_model_gets_them_upright_in_rgb(server, engine, tmp_path, monkeypatch):
    seen = []
    prepare = server.engine.prepare

    def spy(messages, *budget):  # the images the app's engine actually encodes
        prompt = prepare(messages, *budget)
        seen.append(prompt.images)
        return prompt

    monkeypatch.setattr(server.engine, "prepare", spy)
    client = Client(server.url, verbose=False)
    for what, (path, check) in odd_images(tmp_path).items():
        answer, stats = client.predict(message("What is this?", [path]), max_new_tokens=SHORT, api_name="/chat")
        client.predict(api_name="/clear")
        (image,) = seen[-1]
        assert image.mode == "RGB" and check(image), what
        assert answer == reference(engine, [("What is this?", [path], None)], max_new_tokens=SHORT).text, what
        assert stats["prefill_image_tokens"] > 0

    # EXIF: the answer is the one for the same pixels stored upright, not for the stored ones.
    rotated = odd_images(tmp_path)["EXIF-rotated JPEG"][0]
    with Image.open(rotated) as stored:
        stored.load()
        upright = save(stored.transpose(Image.Transpose.ROTATE_270), tmp_path / "upright.png")
        sideways = save(stored.copy(), tmp_path / "sideways.png")
    answer, _ = client.predict(message("Describe the image.", [rotated]), max_new_tokens=12, api_name="/chat")
    client.predict(api_name="/clear")
    assert answer == reference(engine, [("Describe the image.", [upright], None)], max_new_tokens=12).text
    assert answer != reference(engine, [("Describe the image.", [sideways], None)], max_new_tokens=12).text

    # Images without text are a question too.
    answer, _ = client.predict({"text": "", "files": [handle_file(EXAMPLE)]}, max_new_tokens=SHORT, api_name="/chat")
    content = [{"type": "image", "image": load_image(EXAMPLE)}]
    *_, done = engine.stream([{"role": "user", "content": content}], drafter="text",
                             decode=DecodeSettings(max_new_tokens=SHORT))
    assert answer == done.text


def test_a_prompt_over_the_context_counts_its_image_tokens(server, engine, pictures):
    limit = engine.target.model.config.get_text_config().max_position_embeddings
    per_word = len(engine.prepare([user("word " * 200)]).input_ids) - len(engine.prepare([user("word " * 100)]).input_ids)
    base = len(engine.prepare([user("")]).input_ids)
    words = (limit - 2 - base) * 100 // per_word
    text = ("word " * words).strip()  # as the app receives it
    fits = len(engine.prepare([user(text)]).input_ids)
    assert limit - 2 * per_word // 100 - 2 <= fits < limit  # the text alone fits...
    client = Client(server.url, verbose=False)
    with pytest.raises(AppError, match=rf"the prompt is \d+ tokens \([1-9]\d* of them for images\); "
                                       rf"the model's context is {limit}"):
        client.predict(message(text, pictures[:1]), max_new_tokens=SHORT, api_name="/chat")  # ...with an image, not
    answer, stats = client.predict(message(text), max_new_tokens=1, api_name="/chat")
    assert stats["prefill_tokens"] == fits and answer == reference(engine, [(text, [], None)], max_new_tokens=1).text


def user(text: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def test_uploads_are_bounded_in_size(server, tmp_path):
    big = tmp_path / "big.png"
    big.write_bytes(os.urandom(MAX_FILE_BYTES + 1))
    client = Client(server.url, verbose=False)
    with pytest.raises(ValueError, match="exceeds the maximum file size"):  # the client reads the server's limit
        client.predict(message("What is this?", [str(big)]), api_name="/chat")
    # A client that ignores it is refused by the server before the file reaches its disk.
    response = httpx.post(server.url + "gradio_api/upload", files={"files": ("big.png", big.read_bytes(), "image/png")})
    assert response.status_code == 413
    assert client.predict(message("Hi"), max_new_tokens=SHORT, api_name="/chat")[0] is not None


def test_eight_clients_at_once_each_get_the_answer_they_would_get_alone(server, engine, pictures):
    # Each client: its own images and question, then a follow-up that needs its own history.
    plans = [dict(first=(f"Client {i}: what is in these pictures?", pictures[i:i + 1 + i % 2]),
                  second=(f"Client {i}: and the colours?", []),
                  mode="plain" if i % 3 == 0 else "speculative", drafter="ngram" if i % 3 == 2 else "text")
             for i in range(8)]
    results, errors = [None] * 8, []
    start = threading.Barrier(8)

    def visit(i):
        try:
            plan, client = plans[i], Client(server.url, verbose=False)
            settings = dict(mode=plan["mode"], drafter=plan["drafter"], max_new_tokens=8, api_name="/chat")
            start.wait()
            first = client.submit(message(*plan["first"]), **settings).result(timeout=300)
            second = client.submit(message(*plan["second"]), **settings).result(timeout=300)
            results[i] = (first, second)
        except Exception as error:  # reported below, with the client's number
            errors.append((i, error))

    threads = [threading.Thread(target=visit, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    for i, plan in enumerate(plans):
        (first, first_stats), (second, second_stats) = results[i]
        drafter = None if plan["mode"] == "plain" else plan["drafter"]
        alone = reference(engine, [(*plan["first"], None)], drafter, 8)
        assert first == alone.text and first_stats["prefill_tokens"] == alone.stats.prefill_tokens, i
        follow_up = reference(engine, [(*plan["first"], first), (*plan["second"], None)], drafter, 8)
        assert second == follow_up.text, i


def test_twenty_stops_at_random_points_then_an_answer_equal_to_a_fresh_one(server, engine, pictures):
    rng = random.Random(20)
    full = reference(engine, [("Describe the image.", [], None)], None, LONG).token_ids
    tokenizer = engine.target.tokenizer
    client = Client(server.url, verbose=False)
    for i in range(20):
        mode, drafter = rng.choice([("plain", "text"), ("speculative", "text"), ("speculative", "ngram")])
        at = rng.randint(1, MAX_STOP_PASS)
        with Gate(server.engine.target.runner, at) as gate:  # hold the answer at its at-th pass, stop it there
            job = client.submit(message("Describe the image."), mode=mode, drafter=drafter, max_new_tokens=LONG,
                                api_name="/chat")
            gate.wait()
            client.predict(api_name="/stop")
        partial, stats = job.result(timeout=120)
        assert stats["finish_reason"] == "stopped" and stats["target_forwards"] == at, (i, at, stats)
        assert at < stats["new_tokens"] < LONG, i
        # What was streamed is right as far as it went (the text may end inside a character).
        assert partial == tokenizer.decode(full[:stats["new_tokens"]], skip_special_tokens=True), i
        if i % 2:
            client.predict(api_name="/clear")
        else:  # the stopped answer stays in the conversation, and the next turn follows it
            answer, _ = client.predict(message("Go on."), max_new_tokens=SHORT, api_name="/chat")
            expected = reference(engine, [("Describe the image.", [], partial), ("Go on.", [], None)], "text", SHORT)
            assert answer == expected.text, i
            client.predict(api_name="/clear")
    answer, stats = client.predict(message("Describe each image.", pictures[:2]), max_new_tokens=24, api_name="/chat")
    assert answer == reference(engine, [("Describe each image.", pictures[:2], None)], max_new_tokens=24).text
    assert stats["finish_reason"] != "stopped" and not server.engine.lock.locked()


def soak(client: Client, requests: int, pictures: list[str], rng: random.Random) -> dict:
    """`requests` short requests: text or one image, plain or either drafter, 2-4 new tokens,
    a new conversation every 4 turns. Returns what came back."""
    counts = {"answered": 0, "lost": 0}
    for i in range(requests):
        paths = [rng.choice(pictures)] if rng.random() < 0.5 else []
        mode, drafter = rng.choice([("plain", "text"), ("speculative", "text"), ("speculative", "ngram")])
        _, stats = client.predict(message(f"Question {i}?", paths), mode=mode, drafter=drafter,
                                       max_new_tokens=rng.randint(2, 4), api_name="/chat")
        ok = stats["finish_reason"] in ("max_new_tokens", "stop_token") and stats["new_tokens"] >= 1
        counts["answered" if ok else "lost"] += 1
        if i % 4 == 3:
            client.predict(api_name="/clear")
    return counts


@pytest.mark.parametrize("requests", [SOAK_REQUESTS, pytest.param(FULL_SOAK_REQUESTS, marks=pytest.mark.slow)])
def test_soak_answers_every_request_and_memory_stays_bounded(server, engine, pictures, requests):
    client, rng = Client(server.url, verbose=False), random.Random(requests)
    soak(client, 20, pictures, rng)  # warm-up: first uploads, allocator growth, Gradio's caches
    client.predict(api_name="/clear")
    objects, before = live_objects(), rss_bytes()
    started = time.monotonic()
    counts = soak(client, requests, pictures, rng)
    seconds = time.monotonic() - started
    client.predict(api_name="/clear")
    growth, bound = rss_bytes() - before, RSS_SLACK_BYTES + RSS_PER_REQUEST_BYTES * requests
    print(f"soak: {requests} requests in {seconds:.0f} s, {counts}, RSS {before / 2**20:.0f} -> "
          f"{(before + growth) / 2**20:.0f} MB (bound +{bound / 2**20:.0f} MB), live {objects} -> "
          f"{live_objects()}")
    assert counts == {"answered": requests, "lost": 0}
    after = live_objects()  # a KV cache or an image kept per request would add hundreds
    assert after["tensors"] <= objects["tensors"] + 8 and after["images"] <= objects["images"] + 8, (objects, after)
    assert growth <= bound, f"RSS grew by {growth / 2**20:.1f} MB over {requests} requests"
    # And still exact afterwards.
    answer, _ = client.predict(message("Describe each image.", pictures[:2]), max_new_tokens=12, api_name="/chat")
    assert answer == reference(engine, [("Describe each image.", pictures[:2], None)], max_new_tokens=12).text


def fail_on_call(function, n: int, error: Exception):
    """`function`, except that its n-th call raises `error`."""
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise error
        return function(*args, **kwargs)

    return failing


def inject_fault(monkeypatch, drafter, method: str, n: int, error: Exception) -> None:
    """The drafter's n-th `begin`, or the n-th `propose` of the session it begins, raises `error`."""
    if method == "begin":
        monkeypatch.setattr(drafter, "begin", fail_on_call(drafter.begin, n, error))
        return
    begin = drafter.begin

    def begin_with_failing_session(prompt, target_state):
        session = begin(prompt, target_state)
        session.propose = fail_on_call(session.propose, n, error)
        return session

    monkeypatch.setattr(drafter, "begin", begin_with_failing_session)


@pytest.mark.parametrize("drafter,method,call", [("text", "propose", 3), ("text", "begin", 1),
                                                 ("ngram", "propose", 2)])
def test_a_drafter_that_raises_hands_over_to_plain_decoding_and_the_answer_completes(
        server, engine, pictures, monkeypatch, drafter, method, call):
    inject_fault(monkeypatch, server.engine.drafters[drafter], method, call, RuntimeError("injected fault"))
    client = Client(server.url, verbose=False)
    question = ("Describe each image.", pictures[:2])
    first, stats = client.predict(message(*question), drafter=drafter, draft_tokens=4, max_new_tokens=16,
                                  api_name="/chat")  # k fixed: the measured costs do not decide whether it drafts
    assert first == reference(engine, [(*question, None)], None, 16).text  # plain greedy: the same answer
    assert re.match(r"drafter failed in (begin at prefill|propose after \d+ tokens): RuntimeError: injected fault",
                    stats["fallback_reason"]), stats["fallback_reason"]
    assert stats["mode"] == "speculative" and stats["finish_reason"] == "max_new_tokens"
    monkeypatch.undo()
    answer, stats = client.predict(message("And then?"), drafter=drafter, draft_tokens=4, max_new_tokens=8,
                                   api_name="/chat")
    assert stats["fallback_reason"] is None and (stats["drafted"] > 0 or drafter == "ngram")  # n-gram: no match
    assert answer == reference(engine, [(*question, first), ("And then?", [], None)], drafter, 8).text


@pytest.mark.parametrize("where", ["prefill", "extend"])
def test_out_of_memory_in_the_target_ends_the_request_with_a_message_and_the_engine_recovers(
        server, engine, pictures, monkeypatch, where):
    client = Client(server.url, verbose=False)
    first, _ = client.predict(message("Describe each image.", pictures[:2]), max_new_tokens=SHORT, api_name="/chat")
    runner = server.engine.target.runner
    monkeypatch.setattr(runner, where, fail_on_call(getattr(runner, where), 1 if where == "prefill" else 3,
                                                    torch.OutOfMemoryError("simulated: CUDA out of memory")))
    with pytest.raises(AppError, match="out of memory while answering; try fewer or smaller images"):
        client.predict(message("And the chart?", [EXAMPLE]), max_new_tokens=16, api_name="/chat")
    monkeypatch.undo()
    assert not server.engine.lock.locked()
    # The failed turn is not in the conversation: sent again, it gets the answer it would have got.
    answer, _ = client.predict(message("And the chart?", [EXAMPLE]), max_new_tokens=16, api_name="/chat")
    expected = reference(engine, [("Describe each image.", pictures[:2], first), ("And the chart?", [EXAMPLE], None)],
                         max_new_tokens=16)
    assert answer == expected.text


def test_in_the_chat_an_out_of_memory_turn_goes_back_into_the_box_with_the_reason(server, monkeypatch):
    session = Session()
    runner = server.engine.target.runner
    monkeypatch.setattr(runner, "extend", fail_on_call(runner.extend, 2, torch.OutOfMemoryError("simulated")))
    session.pending = new_turn({"text": "Describe the image.", "files": [EXAMPLE]}, server.engine, session)
    with pytest.warns(UserWarning, match="Cannot answer: out of memory while answering"):
        *_, (chatbot, *_, box) = callbacks.respond(server.engine, session, Options(max_new_tokens=8))
    assert box == {"text": "Describe the image.", "files": [EXAMPLE]}  # to send again as it was
    assert session.turns == [] and chatbot == [] and session.pending is None


# --- models that fail to load ---------------------------------------------------------------------

def remote_code_model(folder, marker) -> str:
    """A checkpoint whose config needs its own Python code; the code, if run, writes `marker`."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "custom_vlm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (folder / "configuration_custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\nclass CustomConfig(PretrainedConfig):\n"
        "    model_type = 'custom_vlm'\n")
    return str(folder)


class Unpickled:
    """Pickled weights that, if ever unpickled, create a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def pickle_only_model(source, folder, marker) -> str:
    """`source` with its safetensors weights replaced by a pickle."""
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Unpickled(marker)))
    return str(folder)


def app_error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        app.main(argv + ["--no-browser", "--device", "cpu"])
    return str(stopped.value)


def test_remote_code_runs_only_with_the_flag_and_the_refusal_names_it(zoo, tmp_path, capsys):
    marker = tmp_path / "remote-code-ran"
    model = remote_code_model(tmp_path / "custom", marker)
    assert app_error(["--model", model]) == f"error: {model!r} needs its own code; pass --trust-remote-code if you trust it"
    assert cli_main(["--model", model, "--device", "cpu", "hi"]) == 2
    assert "--trust-remote-code" in capsys.readouterr().err
    assert not marker.exists()
    # With the flag (app and CLI alike) the code runs; this one has no vision tower, which is said next.
    assert "without a vision tower" in app_error(["--model", model, "--trust-remote-code"])
    assert marker.exists()
    assert setup.read_config([], {"VLM_TRUST_REMOTE_CODE": "1"}).trust_remote_code
    assert not setup.read_config([], {}).trust_remote_code


def test_pickled_weights_are_never_loaded(zoo, tmp_path):
    marker = tmp_path / "pickle-ran"
    model = pickle_only_model(zoo.dir("qwen2_vl"), tmp_path / "pickled", marker)
    error = app_error(["--model", model])
    assert "has no safetensors weights; this app loads safetensors only" in error and "\n" not in error
    assert not marker.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_device_names_the_flag_that_fixes_it(zoo):
    with pytest.raises(SystemExit, match="no CUDA device is available; use --device cpu"):
        app.main(["--model", str(zoo.dir("qwen2_vl")), "--device", "cuda", "--no-browser"])


# --- security -------------------------------------------------------------------------------------

def test_binds_to_localhost_and_shares_nothing_unless_asked(server):
    assert server.demo.server_name == "127.0.0.1" and server.demo.share_url is None
    assert setup.read_config([], {}).host == "127.0.0.1" and not setup.read_config([], {}).share
    assert setup.read_config(["--share", "--host", "0.0.0.0"], {}).share
    assert setup.read_config([], {"VLM_SHARE": "1"}).share
    port = int(server.url.rstrip("/").rsplit(":", 1)[1])
    other = other_address()
    if other:  # the port is closed on the machine's other addresses
        with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
            pass


def other_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written (no client-side normalization of "..")."""
    host, port = url.split("//")[1].rstrip("/").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_gradio_serves_uploads_and_bundled_examples_and_nothing_else(server, zoo):
    model_file = f"{zoo.dir('qwen2_vl')}/config.json"  # under the system's temp folder
    refused = ["/etc/passwd", "//etc/passwd", "%2Fetc%2Fpasswd", "../../../../../../etc/passwd",
               "..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd", f"{ROOT}/assets/examples/../../../../../etc/passwd",
               "/tmp/gradio/../../etc/passwd", "/proc/self/environ", f"{ROOT}/app.py", "app.py", model_file,
               f"{ROOT}/assets/examples/../../app.py"]
    for path in refused:
        for prefix in ("/gradio_api/file=", "/file=", "/gradio_api/static/", "/static/", "/assets/"):
            status, body = raw_get(server.url, prefix + path)
            assert status in (400, 403, 404) and b"root:" not in body and b"import" not in body, (prefix, path)
    # The bundled examples and a visitor's own upload are served.
    assert raw_get(server.url, f"/gradio_api/file={EXAMPLE}")[0] == 200
    uploaded = httpx.post(server.url + "gradio_api/upload", files={"files": ("a.png", open(EXAMPLE, "rb"))}).json()[0]
    status, body = raw_get(server.url, f"/gradio_api/file={uploaded}")
    assert status == 200 and body == open(EXAMPLE, "rb").read()


def test_the_api_takes_only_uploaded_files_as_images(server):
    """A request that names a file on the server instead of uploading it never reaches the model;
    a bundled example (public and read-only, as the page's examples send it) passes the door."""
    for path in ("/etc/passwd", EXAMPLE):
        data = [{"text": "hi", "files": [{"path": path, "meta": {"_type": "gradio.FileData"}}]},
                "plain", "text", 4, False, 0.0, 1.0, SHORT, 0, ""]
        posted = httpx.post(server.url + "gradio_api/call/chat", json={"data": data})
        if path != EXAMPLE:  # refused at the door (app_ui/guard.py), naming the file
            assert posted.status_code == 422, posted.text
            assert "is not a file you uploaded to this server" in posted.json()["error"], posted.text
            continue
        stream = httpx.get(server.url + f"gradio_api/call/chat/{posted.json()['event_id']}", timeout=60).text
        assert posted.status_code == 200 and "root:" not in stream, stream


def test_no_secret_reaches_the_logs(server, pictures, tmp_path, monkeypatch, capfd):
    secret = "hf_" + os.urandom(12).hex()
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", secret)
    client = Client(server.url, verbose=False)
    seen = [client.predict(message("Describe each image.", pictures[:2]), max_new_tokens=SHORT, api_name="/chat")]
    (tmp_path / "notes.txt").write_text("not an image")
    for bad in (message("word " * 2100), message("?", [str(tmp_path / "notes.txt")])):
        with pytest.raises(AppError) as refused:
            client.predict(bad, api_name="/chat")
        seen.append(str(refused.value))
    # A model that cannot load, in a process of its own: everything it prints.
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": secret}
    cli = subprocess.run([sys.executable, "app.py", "--model", "nobody/no-such-model", "--no-browser"], cwd=ROOT,
                         env=environ, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and "error: cannot load model 'nobody/no-such-model'" in cli.stderr
    captured = capfd.readouterr()
    for text in [captured.out, captured.err, cli.stdout, cli.stderr, *map(str, seen)]:
        assert secret not in text
