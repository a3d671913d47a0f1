"""Issue 57's targets against a real `python app.py`: under each hostile upload family, sent by 3
visitors at once, the server's memory over idle, and a quiet visitor's first token meanwhile.

    python -m measure.upload_storm                       # the default model (the smol demo), default limits
    python -m measure.upload_storm --strips 1000000 --scans 3000   # smaller files (quicker)
    python -m measure.upload_storm -- --preset demo      # what follows -- goes to app.py

It starts `python app.py --no-browser` (a process of its own: the figures are that process's),
waits until it serves, and reads its idle RSS (VmRSS, `--settle` seconds after it is ready). Then,
for each family (measure/image_bombs.py builds the files: a strip-table TIFF, a repeated-scan
JPEG, a 40,000,000x1 PNG, a 6000x6000 PNG of zeros), three visitors, each from an address of
its own (127.0.58.1-3), upload the file and send it to /chat (`/gradio_api/call/chat`) at once;
one second later a quiet visitor (127.0.58.9) asks a question in text, then one about a small
photo. Printed, one JSON line a family: the server's RSS over idle as the family starts, its peak
RSS over idle (VmHWM, reset for the family through /proc/PID/clear_refs), its RSS over idle once every answer is in and `--settle`
seconds have passed, each visitor's answer (the refusal, shortened), and the quiet visitor's
first token: seconds from its send to its first streamed words, measured here, and the server's
`ttft_s`. The jail's children are processes of their own: their memory is not the server's
(each is bounded by VLM_DECODE_MEMORY_MB). Targets (issue 57): peak at most +1.5 GB, after
within +200 MB, first token within 10 s. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
from PIL import Image

from engine.settings import Settings
from measure.image_bombs import repeated_scan_jpeg, strip_tiff, zeros_png

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1024 * 1024
VISITORS = ("127.0.58.1", "127.0.58.2", "127.0.58.3")
QUIET = "127.0.58.9"
SETTINGS = {**dataclasses.asdict(Settings()), "max_new_tokens": 8}


@dataclasses.dataclass
class Answer:
    """What one /chat call gave: its first words' seconds (from the send), the stats or the error."""

    first_words_s: float | None = None
    stats: dict | None = None
    error: str | None = None


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1]) / 1024


def reset_peak(pid: int) -> None:
    """VmHWM back to the current RSS (Linux: 5 into clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def start_app(app_args: list[str], settle_s: float) -> tuple[subprocess.Popen, str, list[str]]:
    """`python app.py --no-browser --port P`, once it serves: (the process, its URL, its output so far)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = subprocess.Popen([sys.executable, "app.py", "--no-browser", "--port", str(port), *app_args], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    for line in app.stdout:
        lines.append(line.rstrip())
        if line.startswith("Running on"):
            break
    else:
        raise SystemExit("app.py ended before it served:\n" + "\n".join(lines[-20:]))
    threading.Thread(target=lambda: lines.extend(line.rstrip() for line in app.stdout), daemon=True).start()
    time.sleep(settle_s)
    return app, f"http://127.0.0.1:{port}/", lines


def client(source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=600)


def upload(url: str, name: str, data: bytes, source: str) -> dict:
    with client(source) as http:
        (path,) = http.post(url + "gradio_api/upload", files=[("files", (name, data, "image/png"))]).json()
    return {"path": path, "orig_name": name, "meta": {"_type": "gradio.FileData"}}


def chat(url: str, text: str, files: list[dict], source: str) -> Answer:
    """/gradio_api/call/chat, streamed; a new conversation each."""
    answer, sent = Answer(), time.monotonic()
    with client(source) as http:
        posted = http.post(url + "gradio_api/call/chat", json={"data": [{"text": text, "files": files},
                                                                        *SETTINGS.values()]})
        if posted.status_code != 200:
            return Answer(error=posted.text[:200])
        kind = None
        with http.stream("GET", url + f"gradio_api/call/chat/{posted.json()['event_id']}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    kind = line.split(": ", 1)[1]
                elif line.startswith("data:") and kind in ("generating", "complete"):
                    words, stats = json.loads(line[5:])
                    if words and answer.first_words_s is None:
                        answer.first_words_s = time.monotonic() - sent
                    answer.stats = stats
                elif line.startswith("data:") and kind == "error":
                    answer.error = str(json.loads(line[5:]))[:200]
    return answer


def photo() -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise((400, 300), 64).convert("RGB").save(buffer, "PNG")
    return buffer.getvalue()


def families(strips: int, scans: int) -> dict[str, bytes]:
    return {"strips.tif": strip_tiff(strips), "scans.jpg": repeated_scan_jpeg(1024, scans),
            "row.png": zeros_png(40_000_000, 1), "square.png": zeros_png(6000, 6000)}


def storm(url: str, pid: int, idle_mb: float, name: str, data: bytes, settle_s: float) -> dict:
    """One family: three visitors send it at once, a quiet visitor asks meanwhile."""
    files = [upload(url, name, data, source) for source in VISITORS]
    quiet_photo = upload(url, "photo.png", photo(), QUIET)
    answers: dict[str, Answer] = {}

    def ask(source: str, file: dict) -> None:
        answers[source] = chat(url, "What is this?", [file], source)

    start_mb = rss_mb(pid)
    reset_peak(pid)
    senders = [threading.Thread(target=ask, args=(source, file)) for source, file in zip(VISITORS, files)]
    for sender in senders:
        sender.start()
    time.sleep(1.0)
    quiet_text = chat(url, "Say hello.", [], QUIET)
    quiet_picture = chat(url, "What is in the picture?", [quiet_photo], QUIET)
    for sender in senders:
        sender.join()
    peak = rss_mb(pid, "VmHWM")
    time.sleep(settle_s)
    return {"family": name, "mb_on_disk": round(len(data) / 1e6, 2), "start_over_idle_mb": round(start_mb - idle_mb),
            "peak_over_idle_mb": round(peak - idle_mb), "after_over_idle_mb": round(rss_mb(pid) - idle_mb),
            "visitors": [answers[source].error or "answered" for source in VISITORS],
            "quiet_text_first_words_s": quiet_text.first_words_s and round(quiet_text.first_words_s, 1),
            "quiet_text_ttft_s": quiet_text.stats and quiet_text.stats.get("ttft_s"),
            "quiet_picture_first_words_s": quiet_picture.first_words_s and round(quiet_picture.first_words_s, 1),
            "quiet_picture_ttft_s": quiet_picture.stats and quiet_picture.stats.get("ttft_s"),
            "quiet_errors": [answer.error for answer in (quiet_text, quiet_picture) if answer.error]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    app_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m measure.upload_storm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strips", type=int, default=4_000_000, help="the TIFF's strips (20.0 MB: the upload limit is 20 MiB)")
    parser.add_argument("--scans", type=int, default=60_000, help="the JPEG's repeated scans (1024x1024)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before idle and 'after' are read")
    parser.add_argument("--only", nargs="*", help="these families only (strips.tif scans.jpg row.png square.png)")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    built = families(args.strips, args.scans)
    app, url, output = start_app(app_args, args.settle)
    try:
        idle_mb = rss_mb(app.pid)
        print(json.dumps({"server": url, "app_args": app_args, "idle_rss_mb": round(idle_mb)}), flush=True)
        for name, data in built.items():
            if not args.only or name in args.only:
                print(json.dumps(storm(url, app.pid, idle_mb, name, data, args.settle)), flush=True)
    finally:
        app.terminate()
        app.wait(60)


if __name__ == "__main__":
    main()
