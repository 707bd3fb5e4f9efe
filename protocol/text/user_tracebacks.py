"""A user's traceback as a user reads it: their own frames in full, ours and the libraries' folded.

A filter that raises inside ``graph.fit``'s engine, torch's autograd or a daemon's dispatch
leaves a traceback mostly of frames that are not the user's. :func:`folded` keeps every frame of
the user's own files with its source line, and folds each run of other frames (this project's
packages, the standard library, installed packages such as torch) into one line that says how
many and whose. Where the daemon has no copy of the user's file (it ran code pickled by value),
the client, which has it, fills the source line in (:func:`with_source`).
"""

from __future__ import annotations

import linecache
import re
import traceback

from protocol.text.code_owners import file_owner

__all__ = ["folded", "with_source"]

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in .+$')


def folded(exc: BaseException) -> str:
    """``exc``'s traceback (with its chained causes, as Python prints them) with each run of
    frames that are not the user's folded into ``  ... 12 frames of somatize, torch``."""
    lines = "".join(traceback.format_exception(exc)).splitlines()
    kept: list[str] = []
    run: list[str] = []  # the owners of the frames folded so far

    def close_run() -> None:
        if run:
            owners = ", ".join(dict.fromkeys(run))
            kept.append(f"  ... {len(run)} frame{'s' if len(run) > 1 else ''} of {owners}")
            run.clear()

    k = 0
    while k < len(lines):
        line = lines[k]
        frame = _FRAME.match(line)
        if frame is None:
            close_run()
            kept.append(line)
            k += 1
            continue
        # A frame is its "File" line and the indented lines after it (source, carets).
        end = k + 1
        while end < len(lines) and lines[end].startswith("    "):
            end += 1
        owner = file_owner(frame["file"])
        if owner is None:
            close_run()
            kept.extend(lines[k:end])
        else:
            run.append(owner)
        k = end
    close_run()
    return "\n".join(kept) + "\n"


def with_source(trace: str) -> str:
    """``trace`` with the source line of each frame that lacks one filled in from this
    machine's copy of its file, when there is one (the user's script, on the client)."""
    lines = trace.splitlines()
    out: list[str] = []
    for k, line in enumerate(lines):
        out.append(line)
        frame = _FRAME.match(line)
        if frame is None:
            continue
        following = lines[k + 1] if k + 1 < len(lines) else ""
        if following.startswith("    "):
            continue  # its source is there already
        source = linecache.getline(frame["file"], int(frame["line"])).strip()
        if source:
            out.append(f"    {source}")
    return "\n".join(out) + ("\n" if trace.endswith("\n") else "")
