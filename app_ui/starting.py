"""Start-up in the open: each step that may take a while is printed as it begins and with its
time when it ends, and until the app is ready its address answers a small page that says
"Starting…", the step under way (numbered) and the time since the start (the page checks each
second and becomes the app).

    startup = Startup()
    startup.serve(host, port)                 # the address answers "Starting…" from here on
    with startup.step("Loading the model"):   # printed, and named on the page
        engine = load_engine(config)
    startup.close()                           # the port is free for Gradio's server
    demo.launch(server_port=startup.port)

A step shorter than `QUIET_S` that was not announced prints nothing.
"""

from __future__ import annotations

import html
import socket
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

QUIET_S = 1.0
FIRST_PORT, PORTS_TRIED = 7860, 100  # as Gradio chooses a port when none is given
MARKER = "data-vlm-starting"  # the starting page's own attribute: a page without it is the app
PAGE = """<!doctype html><html lang="en" {marker}><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>Starting… · VLM chat</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 20vh auto; max-width: 34rem; padding: 0 1rem;
color: #1f2937; background: #fff; }} @media (prefers-color-scheme: dark) {{ body {{ color: #e5e7eb;
background: #0b0f19; }} }} p {{ color: #6b7280; }}</style></head>
<body><h1 id="starting" role="status">Starting…</h1><p id="step">{step}</p>
<p id="elapsed">{elapsed}</p><p>This page becomes the chat when the model is ready.</p>
<script>setInterval(async () => {{
  try {{
    const page = await (await fetch(location.href, {{ cache: "no-store" }})).text();
    if (!page.includes("{marker}")) {{ location.reload(); return; }}
    const fresh = new DOMParser().parseFromString(page, "text/html");
    for (const id of ["step", "elapsed"]) document.getElementById(id).textContent = fresh.getElementById(id).textContent;
  }} catch (error) {{}}  // between this page and the app the address answers nothing for a moment
}}, 1000);</script></body></html>"""


class Startup:
    """The start-up steps, printed, and the page that stands in for the app until `close()`."""

    def __init__(self, out=None):
        self.out, self.doing, self.began, self.steps = out, "Starting", time.perf_counter(), 0
        self.port, self.server = None, None

    def serve(self, host: str, port: int | None, open_browser: bool = False) -> None:
        """Answer the starting page on host:port (None: the first free port from FIRST_PORT, as Gradio
        would choose), and open the browser on it when asked. OSError when the port is taken."""
        self.port = port if port is not None else free_port(host)
        try:
            self.server = _server(host, self.port, self)
        except OSError as error:
            raise OSError(f"cannot serve on {host}:{self.port} ({error.strerror or error}); pass another --port") \
                from None
        threading.Thread(target=self.server.serve_forever, name="starting-page", daemon=True).start()
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{self.port}/"
        self._print(f"Starting on {url} (the page says \"Starting…\" until the model is ready)")
        if open_browser:
            import webbrowser

            webbrowser.open(url)

    @contextmanager
    def step(self, doing: str, announce: bool = True):
        """Print `doing` (…) as it begins when `announce`, and its time when it ends (when over
        QUIET_S, or announced); the starting page names it meanwhile."""
        self.steps += 1
        self.doing, began = doing, time.perf_counter()
        if announce:
            self._print(f"{doing} …")
        yield
        took = time.perf_counter() - began
        if announce or took >= QUIET_S:
            self._print(f"{doing}: {took:.1f} s")

    def close(self) -> None:
        """Stop answering (the port is free again)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def shown(self) -> tuple[str, str]:
        """The page's two lines: the step under way, numbered, and the time since the start."""
        return f"Step {self.steps}: {self.doing} …", f"{self.ready():.0f} s since the start"

    def ready(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.began

    def _print(self, line: str) -> None:
        print(line, file=self.out or sys.stdout, flush=True)


def free_port(host: str) -> int:
    """The first port from FIRST_PORT that nothing listens on (Gradio's own choice, made early)."""
    for port in range(FIRST_PORT, FIRST_PORT + PORTS_TRIED):
        with socket.socket(_family(host)) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
                return port
            except OSError:
                continue
    raise OSError(f"no free port from {FIRST_PORT} to {FIRST_PORT + PORTS_TRIED - 1}: pass --port")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _server(host: str, port: int, startup: Startup) -> ThreadingHTTPServer:
    class Page(BaseHTTPRequestHandler):
        def do_GET(self):  # every path: the page (a script, an API call: 503, try again)
            wants_page = self.path.split("?")[0] in ("/", "") or "text/html" in self.headers.get("Accept", "")
            step, elapsed = startup.shown()
            body = PAGE.format(marker=MARKER, step=html.escape(step), elapsed=elapsed).encode()
            self.send_response(200 if wants_page else 503)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Retry-After", "2")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args):  # quiet: the steps are what the console shows
            pass

    class Server(ThreadingHTTPServer):
        address_family = _family(host)
        daemon_threads = True

        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that left mid-answer: nothing to say
                super().handle_error(request, client_address)

    return Server((host, port), Page)
