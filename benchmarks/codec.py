"""How fast the frame codec moves one big tensor, next to a plain memory copy.

``python -m benchmarks.codec`` encodes and decodes a 256 MB float32 numpy array and torch tensor
three ways, best of 5 each:

- *transport*: encode, write the parts into one preallocated bytearray (what a transport does
  when it receives a frame), decode. One copy of the data is unavoidable here, so the anchor is
  ``np.copyto`` of the same 256 MB into a preallocated array, and the ratio says how close the
  codec gets to it (1.0 = as fast as a bare copy).
- *join*: encode, ``b"".join`` into a fresh ``bytes``, decode. Slower: a fresh 256 MB
  allocation per frame, and a torch tensor decoded from read-only ``bytes`` is copied once more.
- *zero copy*: encode alone and decode alone (over a bytearray frame), which should take
  microseconds whatever the size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.report import Row, Target
from protocol.codec import decode, encode, encode_frame, frame_nbytes

SIZE_BYTES = 256 * 2**20
REPEATS = 5


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _measure(value: np.ndarray[Any, Any] | torch.Tensor, repeats: int) -> dict[str, float]:
    """Transport and zero-copy figures for one value."""
    frame = bytearray(encode_frame(value))  # the transport's receive buffer, reused
    view = memoryview(frame)
    nbytes = len(frame)

    def transport() -> object:
        position = 0
        for part in encode(value):
            size = frame_nbytes([part])
            view[position : position + size] = part
            position += size
        return decode(frame)

    transport_s = _best(transport, repeats)
    join_s = _best(lambda: decode(b"".join(encode(value))), repeats)
    encode_s = _best(lambda: encode(value), repeats)
    decode_s = _best(lambda: decode(frame), repeats)
    return {
        "transport_s": transport_s,
        "transport_gbps": _gbps(nbytes, transport_s),
        "join_s": join_s,
        "join_gbps": _gbps(nbytes, join_s),
        "encode_s": encode_s,
        "decode_s": decode_s,
        "zero_copy_s": encode_s + decode_s,
        "zero_copy_gbps": _gbps(nbytes, encode_s + decode_s),
    }


def run(size_bytes: int = SIZE_BYTES, repeats: int = REPEATS) -> dict[str, Any]:
    """Measure the codec on ``size_bytes`` of float32, best of ``repeats``.

    Returns:
        ``{"size_bytes", "repeats", "copy": {"seconds", "gbps"}, "numpy": {...}, "torch": {...}}``
        where each library's figures are ``transport_s``, ``transport_gbps``, ``join_s``,
        ``join_gbps``, ``encode_s``, ``decode_s``, ``zero_copy_s``, ``zero_copy_gbps`` and
        ``transport_vs_copy`` (transport throughput over the plain-copy anchor's).
    """
    count = size_bytes // 4
    array = np.random.default_rng(0).random(count, dtype=np.float32)
    tensor = torch.from_numpy(array.copy())
    target = np.empty_like(array)
    np.copyto(target, array)  # touch the pages before timing

    copy_s = _best(lambda: np.copyto(target, array), repeats)
    copy_gbps = _gbps(array.nbytes, copy_s)
    results: dict[str, Any] = {
        "size_bytes": array.nbytes,
        "repeats": repeats,
        "copy": {"seconds": copy_s, "gbps": copy_gbps},
    }
    for name, value in (("numpy", array), ("torch", tensor)):
        figures: dict[str, float] = _measure(value, repeats)
        figures["transport_vs_copy"] = figures["transport_gbps"] / copy_gbps
        results[name] = figures
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: encode + write + decode of each library next to ``np.copyto``."""
    size_mb = results["size_bytes"] / 2**20
    copy_gbps = results["copy"]["gbps"]
    return [
        Row(
            bench="codec",
            name=f"{lib} encode+write+decode {size_mb:.0f} MB float32",
            ours=results[lib]["transport_gbps"],
            unit="GB/s",
            anchor=copy_gbps,
            anchor_name="np.copyto (memcpy)",
            target=Target(">=", 0.5, text=">= 0.5 x memcpy"),
            note=f"decode alone {results[lib]['decode_s'] * 1e6:.0f} µs",
        )
        for lib in ("numpy", "torch")
    ]


def main() -> None:
    results = run()
    size_mb = results["size_bytes"] / 2**20
    copy = results["copy"]
    print(f"frame codec, {size_mb:.0f} MB float32, best of {results['repeats']}")
    print(
        f"  anchor np.copyto            {copy['seconds'] * 1e3:9.1f} ms  {copy['gbps']:7.2f} GB/s"
    )
    for name in ("numpy", "torch"):
        r = results[name]
        print(
            f"  {name:5} encode+write+decode  {r['transport_s'] * 1e3:9.1f} ms  "
            f"{r['transport_gbps']:7.2f} GB/s  ({r['transport_vs_copy']:.2f} x copy)"
        )
        print(
            f"  {name:5} encode+join+decode   {r['join_s'] * 1e3:9.1f} ms  "
            f"{r['join_gbps']:7.2f} GB/s"
        )
        print(
            f"  {name:5} encode+decode only   {r['zero_copy_s'] * 1e6:9.1f} µs  "
            f"(encode {r['encode_s'] * 1e6:.1f} µs, decode {r['decode_s'] * 1e6:.1f} µs)"
        )


if __name__ == "__main__":
    main()
