#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, then runs them (with no arguments: then the
# exactness tests once more without the compiled fast path).
# Debian's chromium drives the browser test (Playwright uses it; it never downloads a browser).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
python3 -m pip install -q -r requirements.txt
python3 -m pytest -q "$@"
if [ $# -eq 0 ]; then
  # The exactness tests again with nothing compiled, as on a machine without a C++ compiler: the
  # Python layer on its own weight layout (engine/fast_native.py, engine/fast_decode.py).
  VLM_NATIVE_LAYER=0 python3 -m pytest -q tests/test_engine_exact.py tests/test_fast_decode.py
fi
