"""llama.cpp built for this CPU from the pinned xllamacpp sdist: `llama-server` and `llama-bench`
(and `llama-quantize`, for the Q4_K_M GGUFs measure/alternate.py puts beside Q4_0: `--quantize`).

    python -m engine.backends.llamacpp_native            # build once (about 20 min on 2 cores), cached
    python -m engine.backends.llamacpp_native --where    # the folder of the binaries, or exit 1
    python -m engine.backends.llamacpp_native --quantize # llama-quantize too (another 15 min or so)

The prebuilt `xllamacpp` wheel is an AVX2-only build; the fair CPU anchor is the same llama.cpp
(the sdist of the installed xllamacpp, `thirdparty/llama.cpp`, the converter's source too:
models/gguf.py) compiled for the machine it runs on. The build goes to
`.gguf/llama.cpp-native-<version>-<features>/` (gitignored), named after the CPU features it was
built for, so a machine with other features builds its own and never runs a binary that would
die on an instruction it lacks.

It is built with `GGML_NATIVE=ON` (`-march=native`: everything this CPU has, AMX included), as
llama.cpp's users build it. AMX matters for decoding too: with it ggml repacks Q4_0 / Q4_1 / Q8_0
weights at load and decodes 1.7-2.3x faster (measured on an Intel Xeon, docs/llamacpp.md). One
trap is patched out of the pinned source first (`AMX_TILE_CONFIG`): GCC 12 drops the stores of
ggml's AMX tile configuration, built on the stack (`ggml_tile_config_init` in
ggml-cpu/amx/mmq.cpp), so any pass over two or more tokens on Q8_0 / Q4 weights died with SIGILL
at `tileloadd`. The patch keeps the configuration in static storage and asks for the tile-data
permission in each thread that loads it (the same fix as upstream's open ggml-org/llama.cpp#26954,
written here). After building, `check_whole` runs `llama-bench -p 512 -n 8` on a small Q8_0 GGUF:
a build whose multi-token passes die is refused with that reason, never used as a slower anchor.
The web UI is not built (it would be downloaded at configure time).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from models.gguf import CACHE, converted, xllamacpp_sdist, xllamacpp_version

TARGETS = ("llama-server", "llama-bench")
QUANTIZE = "llama-quantize"
# /proc/cpuinfo flags that change what -march=native compiles (they name the build's folder).
FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512vbmi",
            "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
OFF = ("BUILD_SHARED_LIBS", "LLAMA_CURL", "LLAMA_OPENSSL", "LLAMA_BUILD_TESTS", "LLAMA_BUILD_EXAMPLES",
       "LLAMA_USE_PREBUILT_UI", "LLAMA_BUILD_UI")
# The AMX tile configuration as the pinned source builds it (on the stack: GCC 12 drops its stores), and
# as the patched source builds it (static storage; the tile-data permission asked for in each thread).
AMX_TILE_CONFIG = ("""    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;""", """    // Patched by vlm-speculative-chat (engine/backends/llamacpp_native.py): the configuration in static
    // storage, which the compiler must keep (GCC 12 dropped the stores into a stack copy), and the
    // tile-data permission asked for in this thread before its first tile instruction.
#if defined(__linux__)
    syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
#endif
    alignas(64) static tile_config_t tc = {};
    tc.palette_id = 1;""")
AMX_SOURCE = "ggml/src/ggml-cpu/amx/mmq.cpp"


class BuildError(RuntimeError):
    """llama.cpp could not be built here; the message says which step and why."""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_options() -> list[str]:
    """The configure options: everything this CPU has (`-march=native`, AMX included: module doc)."""
    return ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", *(f"-D{option}=OFF" for option in OFF)]  # BUILD_SHARED_LIBS
    # off: static binaries, so the two copied out of the build tree run on their own


def build_dir(flags: set[str] | None = None, cache: Path = CACHE) -> Path:
    """Where the build for this CPU's features and the installed xllamacpp's version goes."""
    flags = cpu_flags() if flags is None else flags
    named = [*cmake_options(), *sorted(flag for flag in FEATURES if flag in flags), *AMX_TILE_CONFIG]
    features = hashlib.sha256(" ".join(named).encode()).hexdigest()[:12]
    return cache / f"llama.cpp-native-{xllamacpp_version()}-{features}"


def binary(name: str = "llama-server", cache: Path = CACHE) -> Path | None:
    """The native binary NAME for this CPU if it was built, else None (nothing is built here)."""
    path = build_dir(cache=cache) / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build(cache: Path = CACHE, jobs: int = 2, log=print, targets: tuple[str, ...] = TARGETS) -> Path:
    """Build the `targets` this CPU's folder lacks, once; the folder of the binaries. Binaries already
    there are kept as they are (another process may be running them); new ones are moved in whole."""
    out = build_dir(cache=cache)
    missing = [name for name in targets if not (out / "bin" / name).is_file()]
    if not missing:
        return out / "bin"
    if shutil.which("cmake") is None:
        raise BuildError("cmake is not installed (Debian: apt-get install cmake)")
    source = _source_tree(cache, log)
    work = out.with_name(out.name + ".partial")
    started = time.monotonic()
    log(f"Building {', '.join(missing)} of llama.cpp {xllamacpp_version()} for this CPU in {work} "
        "(about 20 min on 2 cores for all) ...")
    _run(["cmake", "-S", str(source), "-B", str(work), *cmake_options()], "configure")
    _run(["cmake", "--build", str(work), f"-j{jobs}", "--target", *missing], "build")
    if "llama-bench" in missing:
        check_whole(work / "bin" / "llama-bench", cache)
    (out / "bin").mkdir(parents=True, exist_ok=True)
    for name in missing:
        shutil.copy2(work / "bin" / name, out / "bin" / f"{name}.partial")
        os.replace(out / "bin" / f"{name}.partial", out / "bin" / name)
    shutil.rmtree(work, ignore_errors=True)
    log(f"Built {', '.join(missing)} in {time.monotonic() - started:.0f} s: {out / 'bin'}")
    return out / "bin"


# The GGUFs llama-quantize makes from the bf16 one: its type and options. q4_k_m: llama.cpp's default
# mix, as its users run it (Q4_0 of the same weights as `--quantization q4_0`: models/gguf.py).
QUANTIZED = {"q4_k_m": ("Q4_K_M",)}


def quantized_gguf(src: str | os.PathLike, kind: str, cache: Path = CACHE) -> Path:
    """The language model of the checkpoint `src` as a GGUF of `kind` (QUANTIZED), made once by this
    CPU's llama-quantize from its bf16 GGUF (models/gguf.py) and cached beside it."""
    bf16 = converted(src, "bf16", cache=cache)
    path = bf16.with_name(f"model-{kind}.gguf")
    if not path.is_file():
        tool = binary(QUANTIZE, cache)
        if tool is None:
            raise BuildError(f"{QUANTIZE} is not built for this CPU: python -m engine.backends.llamacpp_native --quantize")
        file_type, *options = QUANTIZED[kind]
        partial = path.with_name(path.name + ".partial")
        print(f"Quantizing {bf16} to {file_type} for llama.cpp (once) ...", file=sys.stderr)
        _run([str(tool), *options, str(bf16), str(partial), file_type, str(os.cpu_count() or 1)], "quantize")
        partial.rename(path)
    return path


def check_whole(bench: Path, cache: Path = CACHE) -> None:
    """Refuse a build whose passes over many tokens die (the AMX trap: module doc): `llama-bench -p 512
    -n 8` on the demo's own SmolLM2 Q4_1 file (a type ggml's AMX code repacks)."""
    from models.demo.smol import fetch_gguf

    gguf = fetch_gguf()
    done = subprocess.run([str(bench), "-m", str(gguf), "-p", "512", "-n", "8", "-t", "2", "-r", "1"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"the build's llama-bench -p 512 -n 8 failed (exit {done.returncode}: {last}); "
                         "a build whose multi-token passes die is not used")


def patch_source(tree: Path) -> None:
    """Apply AMX_TILE_CONFIG to the source tree (once; a source without the expected text is refused)."""
    path = tree / AMX_SOURCE
    text = path.read_text()
    pinned, patched = AMX_TILE_CONFIG
    if patched in text:
        return
    if text.count(pinned) != 1:
        raise BuildError(f"{AMX_SOURCE} is not the pinned source this build patches (its AMX tile configuration "
                         "was not found): update AMX_TILE_CONFIG in engine/backends/llamacpp_native.py")
    path.write_text(text.replace(pinned, patched))


def _source_tree(cache: Path, log) -> Path:
    """llama.cpp's whole source tree from the sdist, extracted once and patched (AMX_TILE_CONFIG)."""
    version = xllamacpp_version()
    tree = cache / f"llama.cpp-source-{version}"
    if (tree / "CMakeLists.txt").is_file():
        patch_source(tree)
        return tree
    log(f"Extracting llama.cpp's source from xllamacpp {version}'s sdist ...")
    prefix = f"xllamacpp-{version}/thirdparty/llama.cpp/"
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(xllamacpp_sdist(cache)) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix) and len(m.name) > len(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        archive.extractall(partial, members=members, filter="data")
    patch_source(partial)
    partial.rename(tree)
    return tree


def _run(command: list[str], step: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"llama.cpp's {step} step failed (exit {done.returncode}): {last}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build llama.cpp for this CPU (llama-server, llama-bench; llama-quantize with --quantize).")
    parser.add_argument("--where", action="store_true", help="print the binaries' folder if built; exit 1 if not")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    parser.add_argument("--quantize", action="store_true", help=f"build {QUANTIZE} too")
    args = parser.parse_args(argv)
    if args.where:
        found = binary()
        print(found.parent if found else f"not built for this CPU ({build_dir()})")
        return 0 if found else 1
    try:
        build(jobs=args.jobs, targets=TARGETS + ((QUANTIZE,) if args.quantize else ()))
    except BuildError as error:
        raise SystemExit(f"error: {error}") from None  # exit status 1, the message on stderr
    return 0


if __name__ == "__main__":
    sys.exit(main())
