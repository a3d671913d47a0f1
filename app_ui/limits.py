"""The bounds on what a public server's visitors may hold (docs/security.md), each with its
environment variable, read by engine/schema.py `from_environ` (the one reader of every variable).
app_ui/visitors.py and app_ui/guard.py hold them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.schema import from_environ, setting

MB = 1024 * 1024


def limit(default, help: str, env: str):
    """A field of Limits: its help, its variable, and 0 as its least value (engine/settings.py reads it)."""
    return setting(default, help, low=0, env=env)


@dataclass(frozen=True)
class Limits:
    """The bounds on what visitors may hold (docs/security.md); each from its variable (`from_environ`)."""

    idle_s: float = limit(30 * 60, "a conversation without a request or an answer for this long is emptied",
                          "VLM_IDLE_S")
    unsent_upload_s: float = limit(10 * 60, "an upload no conversation shows is deleted after this",
                                   "VLM_UNSENT_UPLOAD_S")
    upload_bytes_per_client: int = limit(200 * MB, "on disk at once, per client address",
                                         "VLM_UPLOAD_BYTES_PER_CLIENT")
    upload_files_per_client: int = limit(200, "files on disk at once, per client address",
                                         "VLM_UPLOAD_FILES_PER_CLIENT")
    upload_bytes_total: int = limit(2048 * MB, "on disk at once, all clients", "VLM_UPLOAD_BYTES_TOTAL")
    upload_deadline_s: float = limit(300.0, "an upload's body must have arrived within this", "VLM_UPLOAD_DEADLINE_S")
    upload_min_bytes_per_s: int = limit(16 * 1024, "...and, after upload_grace_s, at this average rate at least",
                                        "VLM_UPLOAD_MIN_BYTES_PER_S")
    upload_grace_s: float = limit(10.0, "the first seconds of an upload, not held to the rate", "VLM_UPLOAD_GRACE_S")
    request_bytes: int = limit(4 * MB, "any request body but an upload's", "VLM_REQUEST_BYTES")
    request_deadline_s: float = limit(20.0, "...which must have arrived within this", "VLM_REQUEST_DEADLINE_S")
    request_bytes_per_client: int = limit(8 * MB, "request bodies (not uploads) being read at once, per client "
                                          "address", "VLM_REQUEST_BYTES_PER_CLIENT")
    request_bytes_total: int = limit(64 * MB, "request bodies (not uploads) being read at once, all clients",
                                     "VLM_REQUEST_BYTES_TOTAL")
    files_per_message: int = limit(64, "files one request may name, refused before Gradio opens any (--max-images "
                                   "is 64 at most)", "VLM_FILES_PER_MESSAGE")
    sessions_per_client: int = limit(32, "live sessions (conversations) per client address", "VLM_SESSIONS_PER_CLIENT")
    answers_per_client: int = limit(4, "answers waiting or running per client address (a conversation: one waiting)",
                                    "VLM_ANSWERS_PER_CLIENT")
    pending_turn_s: float = limit(60.0, "a turn accepted whose answer neither waits nor runs is dropped after this",
                                  "VLM_PENDING_TURN_S")
    proxy_hops: int = limit(0, "trusted proxies in front (a Space: 1): the address is this far from "
                            "X-Forwarded-For's right", "VLM_PROXY_HOPS")
    time_budget_s: float = limit(120.0, "wall-clock time one answer may take (then it ends: time_budget; 0: none)",
                                 "VLM_TIME_BUDGET_S")
    decoded_bytes_per_client: int = limit(128 * MB, "uploads' decoded pixels kept (each upload decoded once, at the "
                                          "model's size), per client address; its oldest go first",
                                          "VLM_DECODED_BYTES_PER_CLIENT")
    decoded_bytes_total: int = limit(512 * MB, "...all clients", "VLM_DECODED_BYTES_TOTAL")
    sweep_s: float = limit(10.0, "how often idle conversations and old uploads are swept", "VLM_SWEEP_S")
    # Gradio keeps its own state for this many sessions, the most recently active (the page's
    # components as that visitor last saw them; size per session: docs/app.md); an older one is dropped.
    sessions: int = limit(1000, "sessions whose state Gradio keeps, the most recently active", "VLM_SESSIONS")

    @classmethod
    def from_environ(cls, environ=os.environ, **defaults) -> Limits:
        """`defaults` over Limits' own, and over both each VLM_<FIELD> variable that is set (e.g.
        VLM_TIME_BUDGET_S=60); ValueError names a variable that is not a number of its kind."""
        return from_environ(cls, environ, ValueError, **defaults)
