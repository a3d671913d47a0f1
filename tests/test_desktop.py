"""`python app.py --desktop` (app_ui/desktop.py) under Xvfb: the window opens on the app, a
screenshot of it goes to artifacts/screenshots/desktop.png, and closing the window (as a window
manager's close button asks: WM_DELETE_WINDOW) stops the app. scripts/test.sh installs what it
needs (requirements-desktop.txt; Debian's xvfb, xdotool and Qt's xcb libraries)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import time

import pytest

from models.presets import DEMO_MODEL
from tests.conftest import ROOT
from tests.helpers import WAIT_S, free_port

SCREENSHOTS = os.path.join(ROOT, "artifacts", "screenshots")
TITLE = "VLM chat"
GRAB = """import sys
from PyQt6.QtGui import QGuiApplication
app = QGuiApplication(sys.argv)
image = app.primaryScreen().grabWindow(0).toImage()
colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
image.save(sys.argv[1])
print(len(colours))"""


def _missing() -> str | None:
    try:
        import webview  # noqa: F401
        from PyQt6 import QtWebEngineWidgets  # noqa: F401
    except ImportError as error:
        return f"{error.name} is not installed: pip install -r requirements-desktop.txt (scripts/test.sh does)"
    for tool, package in (("Xvfb", "xvfb"), ("xdotool", "xdotool")):
        if shutil.which(tool) is None:
            return f"{tool} is missing: apt-get install {package} (scripts/test.sh does)"
    if not os.path.isdir(DEMO_MODEL):
        return f"the bundled demo model ({DEMO_MODEL}) is missing"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


@pytest.fixture
def display():
    """A virtual screen (Xvfb) on a free display number."""
    read, write = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "1400x950x24", "-nolisten", "tcp"],
                              pass_fds=[write], stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as number:
        name = f":{number.readline().strip()}"
    yield name
    server.terminate()
    server.wait(10)


def close_window(display: str, window: int) -> None:
    """Send `window` WM_DELETE_WINDOW, as a window manager's close button does (Xlib through ctypes)."""
    xlib = ctypes.cdll.LoadLibrary(ctypes.util.find_library("X11"))
    xlib.XOpenDisplay.restype, xlib.XOpenDisplay.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    xlib.XInternAtom.restype = ctypes.c_ulong
    xlib.XInternAtom.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    xlib.XSendEvent.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    xlib.XFlush.argtypes = xlib.XCloseDisplay.argtypes = [ctypes.c_void_p]

    class ClientMessage(ctypes.Structure):  # XClientMessageEvent, padded to an XEvent's 24 longs
        _fields_ = [("type", ctypes.c_int), ("serial", ctypes.c_ulong), ("send_event", ctypes.c_int),
                    ("display", ctypes.c_void_p), ("window", ctypes.c_ulong), ("message_type", ctypes.c_ulong),
                    ("format", ctypes.c_int), ("data", ctypes.c_long * 5), ("pad", ctypes.c_long * 12)]

    connection = xlib.XOpenDisplay(display.encode())
    assert connection, f"cannot open display {display}"
    event = ClientMessage(type=33, window=window, format=32,  # 33: ClientMessage
                          message_type=xlib.XInternAtom(connection, b"WM_PROTOCOLS", 0))
    event.data[0] = xlib.XInternAtom(connection, b"WM_DELETE_WINDOW", 0)
    xlib.XSendEvent(connection, window, 0, 0, ctypes.byref(event))
    xlib.XFlush(connection)
    xlib.XCloseDisplay(connection)


def wait_for(condition, what: str, app: subprocess.Popen, log: str, timeout: float = 4 * WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert app.poll() is None, f"the app ended ({app.returncode}) before {what}:\n{open(log).read()[-3000:]}"
        time.sleep(1)
    raise AssertionError(f"no {what} after {timeout:.0f} s:\n{open(log).read()[-3000:]}")


def test_the_desktop_window_shows_the_app_and_closing_it_stops_the_app(display, tmp_path):
    environ = {**os.environ, "DISPLAY": display, "PYTHONUNBUFFERED": "1"}
    log = str(tmp_path / "app.log")
    with open(log, "w") as out:
        app = subprocess.Popen([sys.executable, "app.py", "--preset", "demo", "--desktop", "--port", str(free_port())],
                               cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "Running on" in open(log).read(), "app serving", app, log)
        window = wait_for(lambda: subprocess.run(["xdotool", "search", "--name", TITLE], env=environ, text=True,
                                                 capture_output=True).stdout.split(), "window", app, log)
        screenshot = os.path.join(SCREENSHOTS, "desktop.png")
        os.makedirs(SCREENSHOTS, exist_ok=True)

        def rendered() -> bool:  # the page drawn: many colours, and the same in two grabs a second apart
            grabs = [subprocess.run([sys.executable, "-c", GRAB, screenshot], env=environ, text=True,
                                    capture_output=True, check=True).stdout for _ in range(2)]
            return int(grabs[0]) > 200 and grabs[0] == grabs[1]

        wait_for(rendered, "page drawn in the window", app, log)
        close_window(display, int(window[0]))
        app.wait(WAIT_S)
        assert app.returncode == 0, open(log).read()[-3000:]
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
