#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, then runs them (with no arguments: then the
# exactness tests once more without the compiled fast path).
# Debian's chromium drives the browser tests (Playwright uses it; it never downloads a browser); Xvfb,
# xdotool and Qt's xcb libraries let tests/test_desktop.py open `python app.py --desktop`'s window.
# The app needs requirements.txt only (a Space installs that); the tests' tools and the desktop
# window's packages are in requirements-test.txt and requirements-desktop.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
SYSTEM_PACKAGES="chromium xvfb xdotool libxcb-cursor0 libxkbcommon-x11-0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1
  libxcb-randr0 libxcb-render-util0 libxcb-shape0 libxcb-xinerama0 libxcb-xkb1 libegl1"
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=$(for package in $SYSTEM_PACKAGES; do dpkg -s "$package" >/dev/null 2>&1 || echo "$package"; done)
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  fi
fi
python3 -m pip install -q -r requirements.txt -r requirements-test.txt -r requirements-desktop.txt
python3 -m pytest -q "$@"
if [ $# -eq 0 ]; then
  # The exactness tests again with nothing compiled, as on a machine without a C++ compiler: the
  # Python layer on its own weight layout (engine/fast_native.py, engine/fast_decode.py).
  VLM_NATIVE_LAYER=0 python3 -m pytest -q tests/test_engine_exact.py tests/test_fast_decode.py
fi
