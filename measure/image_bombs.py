"""Issue 57's hostile images, built byte by byte, and what opening each costs the server.

    python -m measure.image_bombs                 # each in the jail (engine/image_jail.py), default limits
    python -m measure.image_bombs --in-process    # each with engine/images.py load_image in this process
    python -m measure.image_bombs --strips 4900000 --scans 60000   # the issue's sizes (minutes in-process)
    cd <a checkout of main> && python <this file> --in-process     # main's engine/images.py

Each file is opened as an upload is for a remote model (`fit`: 1536 pixels on the longest side),
one at a time, each in a fresh Python process (so one's memory does not hide the next's). Printed
(JSON, one line a file): its size on disk, the answer (the size, or the refusal), the seconds it
took, and how much the opening process's peak RSS grew (`ru_maxrss`): with --in-process, the
server's own; in the jail, the server's (the child's is its own, bounded by VLM_DECODE_MEMORY_MB).
A measurement, not a test: the seconds depend on this machine. The same builders make the files
of tests/test_image_jail.py.
"""

from __future__ import annotations

import argparse
import io
import json
import struct
import subprocess
import sys
import zlib

from PIL import Image

FIT = {"longest_edge": 1536}  # a remote server's (engine/backends/messages.py LongestSide)


def strip_tiff(strips: int) -> bytes:
    """A 1 x `strips` 8-bit grayscale TIFF, one strip a row, every strip the same byte, written by
    hand: 5 bytes a strip on disk, and Pillow builds a tile entry a strip while opening it (the
    issue's 19.6 MB file: 4.9 M strips, +1,390 MB and 41.8 s before any size check)."""
    entries = 10
    offsets_at = 8 + 2 + 12 * entries + 4
    counts_at = offsets_at + 4 * strips
    pixel_at = counts_at + strips
    tags = [(256, 4, 1, 1), (257, 4, 1, strips), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
            (273, 4, strips, offsets_at), (277, 3, 1, 1), (278, 4, 1, 1), (279, 1, strips, counts_at), (284, 3, 1, 1)]
    ifd = struct.pack("<H", entries) + b"".join(struct.pack("<HHII", *tag) for tag in tags) + struct.pack("<I", 0)
    return (b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack(f"<{strips}I", *([pixel_at] * strips))
            + b"\1" * strips + b"\x80")


def repeated_scan_jpeg(side: int, repeats: int) -> bytes:
    """A flat progressive JPEG whose last scan is repeated `repeats` times: libjpeg decodes each
    (the issue's: 60,000 scans in 4 MB, 149.5 s). 1024x1024 and 3,000 scans: 40 kB, ~9 s here."""
    buffer = io.BytesIO()
    Image.new("L", (side, side), 128).save(buffer, "JPEG", progressive=True, quality=90)
    data, at, scan = buffer.getvalue(), 2, None
    while at < len(data) - 2:
        marker, length = data[at + 1], struct.unpack(">H", data[at + 2:at + 4])[0]
        end = at + 2 + length
        if marker == 0xDA:  # a scan: its header, then entropy-coded data up to the next marker
            while not (data[end] == 0xFF and data[end + 1] not in (0, *range(0xD0, 0xD8))):
                end += 1
            scan = (at, end)
        at = end
    start, end = scan
    return data[:end] + data[start:end] * repeats + data[end:]


def zeros_png(width: int, height: int) -> bytes:
    """A 1-bit grayscale PNG of zeros (a byte a pixel once Pillow decodes it), written chunk by
    chunk without decoding anything: kilobytes on disk for hundreds of megabytes decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row, packer = b"\0" * (1 + (width + 7) // 8), zlib.compressobj(9)
    pixels = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))


# Opens one file (argv: path, "jail" or "in-process") in a fresh interpreter; prints the answer, the
# seconds and the peak RSS it added.
OPEN_ONE = """
import io, json, resource, sys, time
from types import SimpleNamespace
from engine import images
path, where = sys.argv[1], sys.argv[2]
fit, data = SimpleNamespace(size=json.loads(sys.argv[3])), open(path, "rb").read()
if where == "jail":
    from engine.image_jail import ImageJail
    jail, small = ImageJail(), io.BytesIO()
    images.Image.new("RGB", (8, 8)).save(small, "PNG")
    load = jail.load
    load(small.getvalue())  # the child started and ready: its start is not counted
else:
    load = images.load_image
before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
try:
    answer = "x".join(map(str, load(data, name=path.rsplit("/", 1)[-1], fit=fit).size))
except images.ImageError as error:
    answer = str(error)
seconds = time.monotonic() - started
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"answer": answer, "seconds": round(seconds, 1), "peak_rss_grown_mb": round(grown / 2**20)}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m measure.image_bombs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-process", action="store_true", help="decode in this process, as the app did before")
    parser.add_argument("--strips", type=int, default=1_000_000, help="the TIFF's strips")
    parser.add_argument("--scans", type=int, default=3_000, help="the JPEG's repeated scans (1024x1024)")
    parser.add_argument("--folder", default="/tmp", help="where the files are written")
    args = parser.parse_args(argv)
    files = {"strips.tif": strip_tiff(args.strips), "scans.jpg": repeated_scan_jpeg(1024, args.scans),
             "row.png": zeros_png(40_000_000, 1)}
    for name, data in files.items():
        path = f"{args.folder}/{name}"
        with open(path, "wb") as file:
            file.write(data)
        run = subprocess.run([sys.executable, "-c", OPEN_ONE, path, "in-process" if args.in_process else "jail",
                              json.dumps(FIT)], capture_output=True, text=True)
        result = (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                  else {"failed": run.stderr[-300:]})
        print(json.dumps({"file": name, "mb_on_disk": round(len(data) / 1e6, 2), **result}), flush=True)


if __name__ == "__main__":
    main()
