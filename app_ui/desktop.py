"""`python app.py --desktop`: the app in a native window of its own instead of a browser tab
(pywebview on Qt WebEngine, requirements-desktop.txt); closing the window stops the app.

    check()                    # at the start, before any model loads: SetupError says what is missing
    open_window(url)           # blocks (Qt's loop, on the main thread) until the window is closed

The window keeps its own storage (pywebview's profile, not private), so the chats kept in the
browser (app_ui/browser_chats.py) are there at the next start.
"""

from __future__ import annotations

import os
import sys

from app_ui.setup import SetupError

INSTALL = "pip install -r requirements-desktop.txt"
TITLE = "VLM chat · speculative decoding"
SIZE, LEAST = (1280, 860), (380, 600)  # the window's first size and the least it may be made


def check() -> None:
    """SetupError (one line) when the window cannot open: a package missing, or no display."""
    try:
        import webview  # noqa: F401
        from PyQt6 import QtWebEngineWidgets  # noqa: F401
        from qtpy import QtCore  # noqa: F401  (pywebview's Qt layer)
    except ImportError as error:
        raise SetupError(f"--desktop needs pywebview and Qt WebEngine ({error.name} is not installed): {INSTALL}") \
            from None
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        raise SetupError("--desktop needs a display (neither DISPLAY nor WAYLAND_DISPLAY is set); run without it "
                         "and open the address in a browser")


def open_window(url: str) -> None:
    """The app at `url` in a window; returns when the window is closed."""
    import webview

    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Chromium's sandbox refuses to run as root (a container)
        os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")
    webview.create_window(TITLE, url, width=SIZE[0], height=SIZE[1], min_size=LEAST)
    webview.start(gui="qt", private_mode=False)
