"""llama-server in a child process, for engine/backends/llamacpp.py.

    server = ServerProcess(ServerFiles(model, mmproj, draft), threads=2, context=4096)   # native=True / False: a build
    server.handle_chat_completions(body, on_chunk)   # xllamacpp.Server's call, over HTTP
    server.close()

The child is llama.cpp built for this CPU (`llama-server` from engine/backends/llamacpp_native.py)
when it has been built, else the prebuilt wheel's server (`xllamacpp.Server`) in a Python process
of its own (`python -m engine.backends.llamacpp_process --serve ...`). Either way llama.cpp and
this engine never share a process: with both in one, each ran several times slower (their OpenMP
pools and memory; CHANGELOG.md).

`handle_chat_completions(body, on_chunk)` posts the body to the child's /v1/chat/completions and
calls `on_chunk` with each JSON chunk of the server-sent event stream; `on_chunk` returning True
closes the connection, which stops llama-server's generation. An HTTP error, an `error` event or a
child that died reaches `on_chunk` as `{"error": {"message": ...}}`, as the in-process server
reports errors. A child that died mid-answer fails that answer with a message saying so; a child
found dead when a request comes is started again (logged) and answers it.
The child is ended with this process (PR_SET_PDEATHSIG on Linux, set from one long-lived thread)
and by `close()`.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from engine.backends.llamacpp_native import binary
from engine.schema import Switches, switches

START_TIMEOUT_S = 300.0  # loading a 3B GGUF on a busy 2-core machine
READ_TIMEOUT_S = 600.0  # the longest wait for the next line of a stream (a long prompt's prefill)
NATIVE_VARIABLE = Switches.__dataclass_fields__["llamacpp_native"].metadata["spec"].env  # 0: the wheel's server
logger = logging.getLogger(__name__)
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="llama.cpp spawner")  # its thread lives as long as this process


@dataclass(frozen=True)
class ServerFiles:
    model: str
    mmproj: str | None = None
    draft: str | None = None


class ServerError(RuntimeError):
    """The child server could not be started; the message says why."""


class ServerProcess:
    def __init__(self, files: ServerFiles, threads: int = 2, context: int = 4096, native: bool | None = None):
        self.files, self.threads, self.context = files, threads, context
        self.native = uses_native(native)
        if self.native and binary("llama-server") is None:
            raise ServerError("llama.cpp has not been built for this CPU: python -m engine.backends.llamacpp_native")
        if not self.native and not _wheel_installed():
            raise ImportError("xllamacpp is not installed", name="xllamacpp")
        self.kind = build_name(self.native)
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()  # the child's stderr: its last line names a failure
        self.listening_address = ""
        self._start()

    def _start(self) -> None:
        if self.native:
            port = _free_port()
            command = [str(binary("llama-server")), *native_arguments(self.files, self.threads, self.context),
                       "--host", "127.0.0.1", "--port", str(port)]
            self._child = _spawn(command, subprocess.DEVNULL, self._log)
            self.listening_address = f"http://127.0.0.1:{port}"
        else:
            spec = json.dumps({"files": asdict(self.files), "threads": self.threads, "context": self.context})
            self._child = _spawn([sys.executable, "-m", "engine.backends.llamacpp_process", "--serve", spec],
                                 subprocess.PIPE, self._log)
            line = self._child.stdout.readline().decode().strip()  # the address, once the model is loaded
            if not line.startswith("http"):
                raise ServerError(f"{self._stderr_tail()} ({self.kind} exited with code {self._child.wait()})")
            self.listening_address = line
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._child.poll() is not None:
                raise ServerError(f"{self.kind} exited with code {self._child.returncode} while starting: "
                                  f"{self._stderr_tail()}")
            try:
                status, _ = self._request("GET", "/health", timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.close()
        raise ServerError(f"{self.kind} did not answer /health within {START_TIMEOUT_S:.0f} s")

    def _stderr_tail(self) -> str:
        try:
            self._log.seek(0)
            lines = self._log.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            lines = []
        return (lines or ["no output"])[-1][:200]

    def _request(self, method: str, path: str, body: bytes | None = None, timeout: float = READ_TIMEOUT_S):
        address = urllib.parse.urlsplit(self.listening_address)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout)
        try:
            connection.request(method, path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def ensure_running(self) -> str | None:
        """Start the child again if it died; the reason it was restarted, else None."""
        with self._lock:
            if self._child is not None and self._child.poll() is None:
                return None
            code = self._child.returncode if self._child is not None else None
            self._start()
            return f"{self.kind} had exited (code {code}) and was started again"

    def handle_chat_completions(self, body: dict, on_chunk) -> None:
        restarted = self.ensure_running()
        if restarted:
            logger.warning(restarted)
        address = urllib.parse.urlsplit(self.listening_address)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=READ_TIMEOUT_S)
        try:
            connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json", "Accept": "text/event-stream"})
            response = connection.getresponse()
            if response.status != 200:
                on_chunk(_error_chunk(response.read(), f"HTTP {response.status}"))
                return
            for raw in response:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank lines between events, comments
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                if on_chunk(_error_chunk(data.encode(), "an event that is not JSON") if not _is_json(data)
                            else json.loads(data)):
                    return  # closing the connection stops the generation
            on_chunk({"error": {"message": self._broken("the stream ended before [DONE]")}})
        except (OSError, http.client.HTTPException) as error:
            on_chunk({"error": {"message": self._broken(f"the connection broke: {error}")}})
        finally:
            connection.close()

    def _broken(self, what: str) -> str:
        """Why a stream ended early: the child died (it is started again on the next request), or `what`."""
        try:
            self._child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return f"{self.kind}: {what}"
        return f"{self.kind} exited with code {self._child.returncode} mid-answer (started again for the next request)"

    def __del__(self):
        self.close()

    def close(self) -> None:
        child, self._child = getattr(self, "_child", None), None
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def uses_native(native: bool | None = None, environ=os.environ) -> bool:
    """Whether a server runs llama.cpp built for this CPU: `native` where given, else where it has
    been built and VLM_LLAMACPP_NATIVE is not 0."""
    if native is not None:
        return native
    return switches(environ).llamacpp_native and binary("llama-server") is not None


def build_name(native: bool) -> str:
    return "llama.cpp built for this CPU" if native else "the xllamacpp wheel's llama-server"


def native_arguments(files: ServerFiles, threads: int, context: int) -> list[str]:
    """llama-server's flags for the files (tools/server/README.md; common/arg.cpp)."""
    arguments = ["-m", files.model, "-t", str(threads), "-tb", str(threads), "-c", str(context),
                 "--parallel", "1", "--no-warmup", "--no-webui"]
    if files.mmproj:
        arguments += ["--mmproj", files.mmproj]
    if files.draft:
        arguments += ["-md", files.draft, "--spec-type", "draft-simple", "-td", str(threads)]
    return arguments


def wheel_params(files: ServerFiles, threads: int, context: int):
    """xllamacpp.CommonParams for the same server as `native_arguments` (an ephemeral port)."""
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = files.model
    if files.mmproj:
        params.mmproj.path = files.mmproj
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    params.n_ctx, params.n_parallel, params.warmup, params.verbosity = context, 1, False, 0
    if files.draft:
        params.speculative.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        params.speculative.draft.mparams.path = files.draft
        params.speculative.draft.cpuparams.n_threads = threads
        params.speculative.draft.cpuparams_batch.n_threads = threads
    return params


def _wheel_installed() -> bool:
    """Whether the xllamacpp wheel can be imported (the child imports it; this process does not)."""
    try:
        return importlib.util.find_spec("xllamacpp") is not None
    except ValueError:  # sys.modules holds None for it: imports of it are blocked
        return False


def _is_json(data: str) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _error_chunk(raw: bytes, fallback: str) -> dict:
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict) and "error" in decoded:
        return decoded
    return {"error": {"message": f"{fallback}: {raw[:200].decode(errors='replace')}"}}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: end it with a SIGTERM when this process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _spawn(command: list[str], stdout, stderr) -> subprocess.Popen:
    """Start a child from one long-lived thread: PR_SET_PDEATHSIG fires when the thread that
    forked the child ends, and requests (which restart a dead child) run on short-lived threads."""
    def popen():
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    return _SPAWNER.submit(popen).result()


def _serve(spec: str) -> None:
    """The child: the wheel's server on an ephemeral port; prints its address, then serves."""
    import xllamacpp as xlc

    options = json.loads(spec)
    try:
        server = xlc.Server(wheel_params(ServerFiles(**options["files"]), options["threads"], options["context"]))
    except Exception as error:  # its one line is the parent's message
        print(" ".join(str(error).split()) or type(error).__name__, file=sys.stderr, flush=True)
        sys.exit(2)
    print(server.listening_address, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The wheel's llama-server, as a child of the llama.cpp backend.")
    parser.add_argument("--serve", required=True, help="JSON: files, threads, context")
    _serve(parser.parse_args().serve)
