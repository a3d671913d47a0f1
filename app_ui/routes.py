"""The routes this server answers, by name: every route Gradio registers, allowed or refused, each
with its reason. The Guard (app_ui/guard.py) answers 404 to a request that no allowed route
matches, before Gradio reads anything; tests/test_routes.py lists the routes Gradio's app
registers and fails on one this table does not classify.

The table is the same on a Space and off one: the page and gradio_client use the same routes
wherever the app runs, and a local server is one flag (--host 0.0.0.0) away from its network.

A request path matches a route by Gradio's own template (Starlette's `compile_path`), its
trailing "/" ignored; when several routes match (`/gradio_api/call/v2/chat` and
`/gradio_api/call/{api_name}/{event_id}`), every one of them must allow it. A route that is
allowed for some events only (`run/`: the events that skip the queue) names them by a rule
that `Route.event_allowed` checks against the app's events, once the body is read (such a
route takes POST only: the Guard reads every POST body, and no other).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from starlette.routing import compile_path


@dataclass(frozen=True)
class Route:
    methods: frozenset[str]
    template: str  # Gradio's path, as its app registers it, without the trailing "/"
    allowed: bool
    reason: str
    only: str | None = None  # allowed for the events this rule names (`event_allowed`), refused for the rest

    @cached_property
    def pattern(self) -> re.Pattern:
        return compile_path(self.template)[0]

    def event_allowed(self, blocks, path: str, request: dict | None) -> bool:
        """Whether the event a request body names may come this way (`only`), as Gradio finds
        it: by the body's `fn_index`, else by the path's api_name. Without the app's events or
        a body to read, refused."""
        if self.only is None:
            return True
        if blocks is None or not isinstance(request, dict):
            return False
        fn_index, name = request.get("fn_index"), self.pattern.match(path.rstrip("/")).group("api_name")
        fns = [blocks.fns.get(fn_index)] if isinstance(fn_index, int) else \
            [fn for fn in blocks.fns.values() if fn.api_name == name]
        if self.only == SKIPS_QUEUE:  # the page sends such events here (its Stop buttons)
            return bool(fns) and all(fn is not None and fn.queue is False for fn in fns)
        raise ValueError(f"route {self.template}: no rule {self.only!r}")


def route(methods: str, template: str, allowed: bool, reason: str, only: str | None = None) -> Route:
    if only and methods != "POST":  # the rule reads the body, and the Guard reads only POST bodies
        raise ValueError(f"route {template}: a rule on its events needs POST only, not {methods}")
    return Route(frozenset(methods.split()), template.rstrip("/") or "/", allowed, reason, only)


def refused(reason: str, *routes: str, allow: bool = False) -> list[Route]:
    """Routes refused for one reason, each "METHODS TEMPLATE" ("GET HEAD /openapi.json")."""
    return [route(methods, template, allow, reason) for methods, template in (r.rsplit(" ", 1) for r in routes)]


def allowed(reason: str, *routes: str) -> list[Route]:
    """Routes allowed for one reason, as `refused` writes them."""
    return refused(reason, *routes, allow=True)


API = "/gradio_api"
SKIPS_QUEUE = "the events that skip the queue"
PAGE = "the page loads it"
NOT_USED = "neither the page nor gradio_client uses it"
ROUTES = (
    # The page and its assets.
    *allowed(PAGE, "GET HEAD /", "GET /static/{path:path}", "GET /assets/{path:path}", "GET /svelte/{path:path}",
             "GET /favicon.ico", "GET /theme.css", f"GET {API}/theme.css", "GET /manifest.json", "GET /pwa_icon",
             "GET /pwa_icon/{size}"),
    route("GET", "/config", True, "the page and gradio_client read the app's layout"),
    route("GET", "/robots.txt", True, "crawlers read it"),
    route("GET", f"{API}/info", True, "gradio_client and the page's API view read the API's description"),
    route("GET", f"{API}/startup-events", True, "launch calls it once to start the queue; later calls do nothing"),
    # Files: downloads answer only the visitor's own uploads (the Guard's `may_download`).
    route("GET HEAD", f"{API}/file={{path_or_url:path}}", True, "the page shows uploads and examples"),
    route("GET", f"{API}/file/{{path:path}}", True, "Gradio's old name for file="),
    route("POST", f"{API}/upload", True, "the page and gradio_client upload images (metered, counted)"),
    route("GET", f"{API}/upload_progress", True, "the page follows an upload's progress"),
    # Events: through the queue (bounded per conversation and address), or the documented API.
    route("POST", f"{API}/queue/join", True, "the page and gradio_client send every queued event here"),
    route("GET", f"{API}/queue/data", True, "the page and gradio_client read the events' results"),
    route("GET", f"{API}/heartbeat/{{session_hash}}", True, "the page keeps its session alive"),
    route("POST", f"{API}/cancel", True, "gradio_client cancels its own event (by its secret session id)"),
    route("POST", f"{API}/reset", True, "gradio_client's reset; Gradio does nothing there"),
    route("POST", f"{API}/call/{{api_name}}", True, "the documented HTTP API (README: curl): the queue's checks"),
    route("GET", f"{API}/call/{{api_name}}/{{event_id}}", True, "the documented HTTP API's results"),
    route("POST", f"{API}/run/{{api_name}}", True, "the page sends events that skip the queue here (Stop); any "
          "other event would skip the queue's bounds", only=SKIPS_QUEUE),
    route("POST", f"{API}/call/v2/{{api_name}}", False, "takes the message outside `data`, past the file check; "
          "call/ is the documented API"),
    route("GET", f"{API}/call/v2/{{api_name}}/{{event_id}}", False, "call/v2's results"),
    route("POST", f"{API}/api/{{api_name}}", False, "Gradio's old API, outside the queue"),
    route("GET", f"{API}/queue/status", False, NOT_USED),
    route("POST", f"{API}/process_recording", False, "this app records no audio or video; it would keep a "
          "connection's bytes on disk outside every quota"),
    route("POST", f"{API}/component_server", False, "no component of this app asks the server"),
    *refused("this app streams no media", f"POST {API}/stream/{{event_id}}", f"POST {API}/stream/{{event_id}}/close",
             *(f"GET {API}/stream/{{session_hash}}/{{run}}/{{component_id}}/{name}"
               for name in ("playlist.m3u8", "{segment_id}.{ext}", "playlist-file"))),
    # Off: each visitor's conversation is private, and nothing here needs the rest.
    route("GET", f"{API}/deep_link", False, "deep links are off: each visitor's conversation is private"),
    *refused("monitoring is off on this server", "GET /monitoring", "GET /monitoring/summary", "GET /monitoring/{key}"),
    route("GET HEAD", f"{API}/proxy={{url_path:path}}", False, "this app proxies no other Space"),
    route("GET", f"{API}/custom_component/{{id}}/{{environment}}/{{type}}/{{file_name}}", False,
          "this app has no custom components"),
    *refused("run history is off: each visitor's conversation is private", f"GET {API}/runs",
             f"POST {API}/run-history/connect", f"GET {API}/run-history/buckets", f"GET {API}/run-history/records",
             f"GET {API}/run-history/records/{{endpoint}}/{{record_id}}/assets/{{asset_id}}"),
    route("GET", f"{API}/dev/reload", False, "for Gradio's reload mode, which this app does not use"),
    route("GET", f"{API}/app_id", False, NOT_USED),
    *refused(NOT_USED + " (/gradio_api/info describes the API)", f"GET {API}/openapi.json", "GET HEAD /openapi.json"),
    *refused("this app has no login", "POST /login", "GET /logout", f"GET {API}/user", f"GET {API}/login_check",
             f"GET {API}/token"),
    *refused("Gradio's code editor, for development only", f"POST {API}/vibe-edit", f"POST {API}/undo-vibe-edit",
             f"GET POST {API}/vibe-code", f"POST {API}/vibe-starter-queries"),
)


def refusal(method: str, path: str) -> str | None:
    """Why a request for `path` with `method` is not answered (one line), or None. A route that
    is allowed for some events only is checked again once its body is read (`event_refusal`)."""
    matched = _matched(method, path)
    if not matched:
        return f"{method} {_shown(path)}: no such route on this server"
    refusing = next((route for route in matched if not route.allowed), None)
    return f"{method} {_shown(path)}: not served here ({refusing.reason})" if refusing else None


def event_refusal(method: str, path: str, blocks, request: dict | None) -> str | None:
    """Why the event a request's body names (`request`: the body parsed, None if it is not a
    JSON object) may not come by this route (`Route.only`), or None."""
    refusing = next((route for route in _matched(method, path) if not route.event_allowed(blocks, path, request)), None)
    return f"{method} {_shown(path)}: only for {refusing.only}" if refusing else None


def _shown(path: str) -> str:
    """The path as a refusal names it: its start, one printable line (it is the visitor's text)."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in path[:80])


def _matched(method: str, path: str) -> list[Route]:
    path = path.rstrip("/") or "/"
    return [route for route in ROUTES if method in route.methods and route.pattern.match(path)]


def classified(method: str, template: str) -> Route | None:
    """The route of this table for Gradio's route `template` and `method`, or None."""
    template = template.rstrip("/") or "/"
    return next((route for route in ROUTES if method in route.methods and route.template == template), None)
