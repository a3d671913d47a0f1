"""Uploads left by a process that ended: each process lists its uploads in a journal
(`<pid>-<port>.txt`) in a folder beside the upload folder, outside every folder Gradio serves
(app_ui/visitors.py `Visitors._journal`), and the next process deletes what a dead one listed."""

from __future__ import annotations

import contextlib
import os


def journal_folder(uploads: str) -> str:
    """Where the journals of uploads to the folder `uploads` are: beside it, never inside (Gradio
    serves what is inside)."""
    uploads = os.path.abspath(uploads)
    return os.path.join(os.path.dirname(uploads), os.path.basename(uploads) + "-vlm-journals")


def sweep_journals(folder: str) -> int:
    """Delete the uploads listed in the journals (`<pid>-<port>.txt` in `folder`) of processes that
    are no longer running, and those journals; returns how many files went. A path that a live
    process's journal lists too is kept."""
    if not os.path.isdir(folder):
        return 0
    dead, live = [], set()
    for name in os.listdir(folder):
        pid = name.removesuffix(".txt").split("-")[0]
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError), open(os.path.join(folder, name)) as file:
            paths = file.read().split("\n")
        if _running(int(pid)):
            live.update(paths)
        else:
            dead.append((os.path.join(folder, name), paths))
    removed = 0
    for journal, paths in dead:
        for path in set(paths) - live - {""}:
            with contextlib.suppress(OSError):
                os.remove(path)
                removed += 1
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))
        with contextlib.suppress(OSError):
            os.remove(journal)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
