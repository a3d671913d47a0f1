"""One address floods a running app's queue; how long does another visitor wait for a first token?

    python app.py --no-browser --port 7951 &
    python -m measure.queue_flood http://127.0.0.1:7951/ [--flood 50] [--max-new-tokens 1024] [--pause 1]

`--flood` /gradio_api/call/chat requests from 127.0.20.1, one after another (each a new session,
plain decoding), their streams read in threads; after `--pause` seconds one request from
127.0.20.2. Printed (JSON): how many of the flood were queued and refused, the other visitor's
first text from the client's clock (from its POST), and its `ttft_s` and `queue_wait_s` as the
app reports them. A measurement, not a test: the figures depend on how long the flood's answers
take on this machine.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx

FLOOD, VISITOR = "127.0.20.1", "127.0.20.2"


def chat_data(text: str, max_new_tokens: int) -> list:
    """/chat's positional data: the message, then every setting in the schema's order."""
    from engine.settings import Settings

    settings = Settings(mode="plain", max_new_tokens=max_new_tokens)
    return [{"text": text, "files": []}, *(getattr(settings, name) for name in settings.__dataclass_fields__)]


def post(url: str, source: str, data: list) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=600) as client:
        return client.post(url + "gradio_api/call/chat", json={"data": data})


def read(url: str, source: str, event: str, sent: float) -> tuple[float | None, list | None]:
    """(seconds from `sent` to the first text, the last outputs) of an event's stream."""
    first, last, kind = None, None, None
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=600) as client:
        with client.stream("GET", url + f"gradio_api/call/chat/{event}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    kind = line.split(": ", 1)[1]
                elif line.startswith("data:") and kind in ("generating", "complete"):
                    last = json.loads(line[5:])
                    if first is None and last and last[0]:
                        first = time.perf_counter() - sent
    return first, last


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--flood", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--pause", type=float, default=1.0)
    args = parser.parse_args(argv)
    url = args.url if args.url.endswith("/") else args.url + "/"
    codes, events = [], []
    for i in range(args.flood):
        response = post(url, FLOOD, chat_data(f"Flood {i}: describe a red square at length.", args.max_new_tokens))
        codes.append(response.status_code)
        if response.status_code == 200:
            events.append(response.json()["event_id"])
    for event in events:
        threading.Thread(target=read, args=(url, FLOOD, event, 0.0), daemon=True).start()
    time.sleep(args.pause)
    sent = time.perf_counter()
    response = post(url, VISITOR, chat_data("Describe a blue circle.", args.max_new_tokens))
    first, (_, stats) = read(url, VISITOR, response.json()["event_id"], sent)
    print(json.dumps({"flood_sent": args.flood, "flood_queued": len(events), "flood_refused": len(codes) - len(events),
                      "visitor_first_text_s": round(first, 2) if first is not None else None,
                      "visitor_ttft_s": stats["ttft_s"], "visitor_queue_wait_s": stats.get("queue_wait_s")}))


if __name__ == "__main__":
    main()
