"""The jailed image decoder: `python -m engine.image_child LIMITS_JSON`, started by
engine/image_jail.py, decodes one visitor's file at a time with engine/images.py `decode_file`
and hands the pixels back; nothing else (no model, no torch, no server) is in this process.

Its limits, set before it reads any job: the address space (RLIMIT_AS, `memory_mb`), Pillow's
pixel bound (`use_pixel_bound`), and per job a CPU limit (RLIMIT_CPU's soft limit moved to the
seconds used so far plus `cpu_s`: past it the kernel sends SIGXCPU, whose default action ends the
process; no handler is installed, as a Python handler would run only after the decoder's C
call returns). The hard CPU limit is `cpu_s` x `JOBS_PER_CHILD`: a child that has used most of
it says so in its reply (`retire`) and the pool starts another. The parent kills the child at
its wall-clock deadline.

The protocol, on stdin / stdout, each message a 4-byte big-endian length and a JSON object:
    child:  {"ready": pid}                 (once, its imports and limits done)
    parent: {"name", "path" or "data_bytes" (that many raw bytes follow), "max_bytes",
             "max_pixels", "max_decoded_bytes", "fit": bool, "resample": int}
    child:  {"header": [width, height]}   (with "fit": the upright size, once the header is read)
    parent: {"target": [width, height] or null}, or {"refused": "name: why"} (a shape the
            model's processor refuses: the child refuses the file without decoding it)
    child:  {"size": [width, height], "pid": ..., "retire": bool} then width x height x 3 bytes
            (8-bit RGB, row by row), or {"refused": "name: why", "retire": bool}
The parent parses only JSON and a byte count it checks: nothing a decoder made is unpickled.
A MemoryError (the address space is full) is refused naming the limit, and the child ends, so
that its heap is new for the next file; one that comes where no refusal can be sent ends the
child with OUT_OF_MEMORY, which the parent names the same way.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys

JOBS_PER_CHILD = 50  # the hard CPU limit is this many jobs' CPU limit
OUT_OF_MEMORY = 3  # the exit status of a child whose MemoryError came where it could not refuse the file
_LENGTH = struct.Struct(">I")


def send(stream, message: dict, payload: bytes = b"") -> None:
    data = json.dumps(message).encode()
    stream.write(_LENGTH.pack(len(data)) + data)
    if payload:
        stream.write(payload)
    stream.flush()


def receive(read_exact) -> dict | None:
    """The next message, `read_exact(n)` giving n bytes (b"" at the end); None at the end."""
    head = read_exact(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return json.loads(read_exact(_LENGTH.unpack(head)[0]))


def _reader(stream):
    def read_exact(size: int) -> bytes:
        chunks, left = [], size
        while left:
            chunk = stream.read(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    return read_exact


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(limits: dict) -> None:
    memory = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu_s, lifetime = limits["cpu_s"], limits["cpu_s"] * JOBS_PER_CHILD
    resource.setrlimit(resource.RLIMIT_CPU, (lifetime, lifetime))
    from engine import images  # PIL and numpy: imported under the limits

    images.use_pixel_bound(limits["max_pixels"])
    read_exact, out = _reader(sys.stdin.buffer), sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print cannot corrupt the protocol
    send(out, {"ready": os.getpid()})
    while (job := receive(read_exact)) is not None:
        source = job["path"] if job.get("path") is not None else read_exact(job["data_bytes"])
        soft = min(lifetime, int(_cpu_used()) + cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, lifetime))

        def target_for(width: int, height: int):
            send(out, {"header": [width, height]})
            answer = receive(read_exact) or {}
            if "refused" in answer:  # a shape the model's processor refuses: not decoded
                raise images.ImageError(str(answer["refused"]))
            return tuple(answer["target"]) if answer.get("target") else None

        retire = _cpu_used() + 2 * cpu_s > lifetime
        try:
            image = images.decode_file(source, job["name"], job["max_bytes"], job["max_pixels"],
                                       job["max_decoded_bytes"], target_for if job["fit"] else None,
                                       images.Image.Resampling(job["resample"]))
        except images.TooLarge:
            send(out, {"refused": f"{job['name']}: needed more than {limits['memory_mb']:,} MB to decode (the "
                                  "server's limit for one image); send a smaller image", "retire": True})
            return
        except images.ImageError as error:
            send(out, {"refused": str(error), "retire": retire})
        else:
            send(out, {"size": list(image.size), "pid": os.getpid(), "retire": retire}, image.tobytes())
            del image
        if retire:
            return


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except MemoryError:  # e.g. while naming the file's refusal: the parent names the limit
        os._exit(OUT_OF_MEMORY)
