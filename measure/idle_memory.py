"""Where an idle `python app.py` holds its memory: the engine built as app.py builds it, then every
tensor storage reachable from it, by the mapping it lies in and the objects that hold it.

    python -m measure.idle_memory                  # the default model (the smol demo)
    python -m measure.idle_memory -- --preset demo # what follows -- goes to app.py's flags

It reads the settings (app_ui/setup.py `read_config`), assembles the smol demo if that is the
model, loads the engine (`load_engine`) and warms it up (`warm_up`), as app.py does, without the
page. Then it reads /proc/self/smaps (each mapping's resident MB) and walks the engine's objects:
each runner's model (its parameters and buffers, by name), its fast path's stack (the fused
products, the GGUF blocks, `PackedWeight`, `Adapted`), and any other tensor that the garbage
collector sees. Printed: VmRSS after each step, then one line a mapping over 8 MB (resident
MB, what it is: the model file, a huge-page arena, the heap), and under each the storages that
lie in it (MB, their holders), and VmRSS after a second `malloc_trim(0)` (`warm_up` ends with
one, as in the app: what is left to give back). A measurement of this process, not of
the server's: the page, Gradio's sessions and the jail are not in it (app.py's idle RSS was
about 160 MB more on 8 December: docs/app.md).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import re
import sys

MB = 1024 * 1024


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def mappings() -> list[tuple[int, int, str, float]]:
    """(start, end, name, resident MB) of this process's mappings, by start."""
    found, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
            if head:
                current = [int(head.group(1), 16), int(head.group(2), 16), head.group(3) or "[anonymous]", 0.0]
                found.append(current)
            elif line.startswith("Rss:") and current is not None:
                current[3] = int(line.split()[1]) / 1024
    return sorted(tuple(mapping) for mapping in found)


def holders(engine) -> dict[int, list[str]]:
    """Storage address -> the names that hold a tensor on it: each runner's model parameters and
    buffers, its fast path's fused products and blocks."""
    import torch

    named: dict[int, list[str]] = collections.defaultdict(list)
    target = engine.target
    runners = {"text runner": target.runner, "picture runner": target.picture_runner}
    for label, runner in runners.items():
        if runner is None:
            continue
        for name, tensor in [*runner.model.named_parameters(), *runner.model.named_buffers()]:
            named[tensor.untyped_storage().data_ptr()].append(f"{label}.model.{name}")
        fast = runner.fast
        if fast is None:
            continue
        for index, layer in enumerate(fast.stack.layers):
            for field, value in vars(layer).items():
                for tensor in _tensors(value):
                    named[tensor.untyped_storage().data_ptr()].append(
                        f"{label}.fast.stack.layers[{index}].{field} ({type(value).__name__})")
        for tensor in _tensors(fast.head_weight):
            named[tensor.untyped_storage().data_ptr()].append(f"{label}.fast.head_weight ({type(fast.head_weight).__name__})")
    for obj in gc.get_objects():  # the rest, unnamed
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            named.setdefault(obj.untyped_storage().data_ptr(), [f"a {type(obj).__name__} nobody above names"])
    return named


def _tensors(value) -> list:
    """The tensors a value holds: itself, or a small object's tensor fields (PackedWeight, Adapted...)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    fields = getattr(value, "__dict__", None) or {slot: getattr(value, slot, None)
                                                  for slot in getattr(type(value), "__slots__", ())}
    return [tensor for item in fields.values() if isinstance(item, (torch.Tensor, list, tuple)) for tensor in _tensors(item)]


def report(engine) -> None:
    import torch

    maps = mappings()
    starts = [start for start, *_ in maps]
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    named = holders(engine)
    by_map: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for address, size in storages.items():
        at = bisect.bisect_right(starts, address) - 1
        if at >= 0 and maps[at][0] <= address < maps[at][1]:
            by_map[at].append((address, size))
    for index, (start, end, name, resident) in enumerate(maps):
        held = sum(size for _, size in by_map.get(index, []))
        if resident < 8:
            continue
        print(f"{resident:7.0f} MB resident  {(end - start) / MB:7.0f} MB mapped  {name}  (tensors in it: {held / MB:.0f} MB)")
        groups: dict[str, int] = collections.Counter()
        for address, size in by_map.get(index, []):
            names = named.get(address, ["?"])
            kind = _kind(names)
            groups[kind] += size
        for kind, size in groups.most_common(6):
            if size >= MB:
                print(f"      {size / MB:7.1f} MB  {kind}")


def _kind(names: list[str]) -> str:
    """A storage's holders, each layer's written once (layers.N): the first 24, and how many more."""
    shown = sorted({re.sub(r"\.(\d+)\.", ".N.", re.sub(r"\[\d+\]", "[N]", name)) for name in names})
    return "\n          ".join(shown[:24]) + (f"\n          and {len(shown) - 24} more" if len(shown) > 24 else "")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    app_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m measure.idle_memory", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    print(f"python and this module: VmRSS {rss_mb():.0f} MB", flush=True)
    from app_ui.setup import assemble_target, load_engine, read_config, warm_up
    from engine import fast_native
    from models.presets import SMOL_DEMO

    config = read_config(app_args)
    if config.model == SMOL_DEMO:
        config = assemble_target(config)
    fast_native.layer()
    print(f"imports and the compiled layer: VmRSS {rss_mb():.0f} MB", flush=True)
    engine = load_engine(config)
    print(f"engine built: VmRSS {rss_mb():.0f} MB", flush=True)
    warm_up(engine)
    gc.collect()
    print(f"warmed up: VmRSS {rss_mb():.0f} MB", flush=True)
    report(engine)
    from app_ui.uploads import return_freed_memory

    return_freed_memory()  # glibc's malloc_trim(0) again: what the warm-up's own trim left
    print(f"after another malloc_trim(0): VmRSS {rss_mb():.0f} MB", flush=True)


if __name__ == "__main__":
    main()
