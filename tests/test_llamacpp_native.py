"""llama.cpp built for this CPU (engine/backends/llamacpp_native.py) and the choice of build: the
llama.cpp backend's child server (engine/backends/llamacpp_process.py `uses_native`) and the
benchmark's llama.cpp rows (`python -m measure.bench --llamacpp native`: rows from both builds).
The build itself (20 minutes) is not run here; the tests that start a server use the one built in
.gguf/ where it is there."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.backends import llamacpp_native, llamacpp_process
from engine.backends.llamacpp_native import binary, build_dir, cmake_options
from engine.backends.llamacpp_process import NATIVE_VARIABLE, build_name, uses_native
from measure import bench, llamacpp_rows
from tests.helpers import DEMO_TARGET, DEMO_TEXT_DRAFTER

NATIVE = binary("llama-server")
needs_native = pytest.mark.skipif(NATIVE is None, reason="llama.cpp is not built for this CPU here "
                                                         "(python -m engine.backends.llamacpp_native)")


def test_the_build_has_everything_the_cpu_has_and_a_folder_per_feature_set():
    options = cmake_options()
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"} <= set(options)
    assert not any("AMX" in option for option in options)  # -march=native decides, AMX included
    assert build_dir({"avx2"}) != build_dir({"avx2", "avx512f"})  # each feature set builds its own
    assert build_dir({"avx512f", "avx512_vnni"}) != build_dir({"avx512f", "avx512_vnni", "amx_tile", "amx_int8"})


def test_the_amx_tile_configuration_is_patched_once_and_an_unknown_source_is_refused(tmp_path):
    """The pinned source's stack-built tile configuration (GCC 12 drops its stores) becomes a static
    one, once; a source without the text the patch expects is refused with the reason."""
    source = tmp_path / llamacpp_native.AMX_SOURCE
    source.parent.mkdir(parents=True)
    pinned, patched = llamacpp_native.AMX_TILE_CONFIG
    source.write_text("inline void ggml_tile_config_init(void) {\n" + pinned + "\n}\n")
    for _ in range(2):
        llamacpp_native.patch_source(tmp_path)
        assert source.read_text().count("static tile_config_t tc") == 1 and pinned not in source.read_text()
    source.write_text("upstream changed this file\n")
    with pytest.raises(llamacpp_native.BuildError, match="not the pinned source"):
        llamacpp_native.patch_source(tmp_path)


def test_a_binary_is_found_only_where_built_and_executable(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_native, "cpu_flags", lambda cpuinfo=None: {"avx2"})
    assert binary("llama-server", cache=tmp_path) is None
    path = build_dir(cache=tmp_path) / "bin" / "llama-server"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    assert binary("llama-server", cache=tmp_path) is None  # not executable
    path.chmod(0o755)
    assert binary("llama-server", cache=tmp_path) == path


def test_the_native_build_is_used_where_built_unless_the_variable_says_0():
    assert uses_native(True, {NATIVE_VARIABLE: "0"}) and not uses_native(False, {})
    assert uses_native(None, {NATIVE_VARIABLE: "0"}) is False
    assert uses_native(None, {}) is (NATIVE is not None) and uses_native(None, {NATIVE_VARIABLE: "1"}) is (NATIVE is not None)


@needs_native
def test_the_llamacpp_backend_runs_the_build_it_is_given():
    """The same request on the demo model from llama.cpp built for this CPU and from the wheel's
    server, each in its own child process: both answer; by default the native one runs."""
    from engine.backend import Request
    from engine.backends.llamacpp import LlamaCpp
    from engine.loop import DecodeSettings

    request = Request([{"role": "user", "content": [{"type": "text", "text": "Describe a red circle."}]}],
                      decode=DecodeSettings(max_new_tokens=8))
    texts = {}
    for native in (True, False, None):
        backend = LlamaCpp.from_checkpoint(DEMO_TARGET, threads=1, native=native)
        try:
            command = backend.server._child.args
            assert backend.server.native is (native is not False) and backend.server.kind == build_name(native is not False)
            assert (command[0] == str(NATIVE)) is (native is not False)
            assert ("engine.backends.llamacpp_process" in command) is (native is False)
            *_, done = backend.stream(request)
            texts[native] = done.text
        finally:
            backend.close()
    assert texts[True] and texts[False] and texts[None] == texts[True]


def test_a_native_server_asked_where_none_is_built_is_a_named_error(monkeypatch):
    from engine.backends import llamacpp_process
    from engine.backends.llamacpp_process import ServerError, ServerFiles, ServerProcess

    monkeypatch.setattr(llamacpp_process, "binary", lambda name="llama-server": None)
    with pytest.raises(ServerError, match="not been built for this CPU: python -m engine.backends.llamacpp_native"):
        ServerProcess(ServerFiles("model.gguf"), native=True)


def engine_with_text_drafter():
    """What the benchmark's llama.cpp rows read of the engine: its drafters and its target's dtype."""
    return SimpleNamespace(drafters={"text": SimpleNamespace(name=DEMO_TEXT_DRAFTER, kind="text_lm"),
                                     "ngram": SimpleNamespace(name="ngram", kind="ngram")},
                           target=SimpleNamespace(model=torch.nn.Linear(2, 2).to(torch.bfloat16)))


def test_bench_llamacpp_native_makes_rows_from_both_builds_each_named(monkeypatch):
    """The rows are only named here (no server starts), so a native build is assumed present,
    as on a machine where it was built: CI's fresh machine has none."""
    built = lambda name="llama-server", cache=None: Path("/built") / name  # noqa: E731
    monkeypatch.setattr(llamacpp_native, "binary", built)
    monkeypatch.setattr(llamacpp_process, "binary", built)
    engine = engine_with_text_drafter()
    phases = bench.llamacpp_phases(["q8_0", "native"], engine, DEMO_TARGET)
    assert [[label for _, label, _ in phase.specs] for phase in phases] == [
        ["q8_0, native", "text turns, q8_0, native"], ["q8_0, prebuilt", "text turns, q8_0, prebuilt"],
        ["text_drafter, text turns, q8_0, native"], ["text_drafter, text turns, q8_0, prebuilt"]]
    default = bench.llamacpp_phases([], engine, DEMO_TARGET)  # bf16 as the target; the native build where built
    build = "native"
    assert [[label for _, label, _ in phase.specs] for phase in default] == [
        [build, f"text turns, {build}"], [f"text_drafter, text turns, {build}"]]
    assert [[label for _, label, _ in phase.specs] for phase in bench.llamacpp_phases(["q8_0"], engine, DEMO_TARGET)
            ][0] == [f"q8_0, {build}", f"text turns, q8_0, {build}"]
    with pytest.raises(SystemExit, match="one GGUF type"):
        bench.llamacpp_phases(["f32", "q8_0"], engine, DEMO_TARGET)


def test_bench_llamacpp_native_refuses_where_nothing_is_built(monkeypatch):
    monkeypatch.setattr(llamacpp_native, "binary", lambda name="llama-server", cache=None: None)
    with pytest.raises(SystemExit, match="--llamacpp native: llama.cpp has not been built for this CPU"):
        bench.llamacpp_phases(["native"], engine_with_text_drafter(), DEMO_TARGET)


def test_a_drafting_row_is_compared_with_the_plain_text_row_of_its_own_build():
    rows = [SimpleNamespace(text_turns=text_turns, drafter=drafter, native=native, name=f"{drafter} {native} {text_turns}")
            for native in (True, False) for drafter, text_turns in ((None, False), (None, True), ("text", True))]
    for row in rows:
        if row.drafter:
            assert llamacpp_rows.text_plain_row(row, rows).name == f"None {row.native} True"
