"""What ``somatize`` prints: its tables and one-line texts, from the coordinator's records.

No I/O: each function turns a status snapshot, a job record or an event into what the CLI
shows (and the status page says the same in JavaScript). Cells are ``rich.Text`` with control
characters escaped, never read as markup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from protocol.text.wording import listed, visible
from somatize.cli.progress import event_text

__all__ = [
    "cells",
    "clients_table",
    "describe_state",
    "device_text",
    "dtype_name",
    "duration_text",
    "jobs_table",
    "placed_text",
    "position_text",
    "progress_text",
    "queue_table",
    "queued_text",
    "replica_text",
    "submitted_text",
    "wait_text",
    "workers_table",
]


def workers_table(workers: list[dict[str, Any]]) -> Any:
    """The workers of a status snapshot as ``somatize status`` prints them."""
    from rich.table import Table

    table = Table(title="workers", title_justify="left")
    columns = ("id", "tags", "state", "device", "sandbox", "datasets", "heartbeat", "job")
    for column in columns:
        table.add_column(column, no_wrap=column in ("id", "device"))
    for w in workers:
        age = w.get("last_heartbeat_age")
        capabilities = w.get("capabilities")
        said = capabilities if isinstance(capabilities, dict) else {}
        table.add_row(
            *cells(
                w.get("id", ""),
                ", ".join(str(t) for t in w.get("tags") or []),
                w.get("state", ""),
                device_text(said),
                said.get("sandbox") or "?",
                datasets_text(w.get("datasets")),
                f"{age:.1f} s ago" if isinstance(age, int | float) else "",
                w.get("job_id") or "",
            )
        )
    return table


def cells(*values: Any) -> list[Any]:
    """Table cells that show what they hold: never read as rich markup (a tag ``[red]``), and
    control characters (a worker id with an escape sequence) shown escaped, not sent to the
    terminal."""
    from rich.text import Text

    return [Text(visible(str(value), lines=False)) for value in values]


def device_text(capabilities: dict[str, Any]) -> str:
    """A worker's training device in a few words: ``cpu``, ``cuda:0 NVIDIA H200 139.8 GiB``
    (the status page's ``deviceText`` says the same)."""
    parts = [str(capabilities.get("device") or "cpu")]
    if capabilities.get("device_name"):
        parts.append(str(capabilities["device_name"]))
    memory = capabilities.get("device_memory_bytes")
    if isinstance(memory, int | float) and not isinstance(memory, bool) and memory > 0:
        parts.append(f"{memory / 2**30:.1f} GiB")
    return " ".join(parts)


def datasets_text(datasets: Any) -> str:
    """A worker's datasets in a few words each: ``mnist 60000 × 784 float32 → int64`` (the
    status page's ``datasetsText`` says the same)."""
    if not isinstance(datasets, dict):
        return ""
    parts = []
    for name, d in sorted(datasets.items()):
        d = d if isinstance(d, dict) else {}
        words = [str(name), str(d.get("rows", "?"))]
        x, y = d.get("x"), d.get("y")
        if isinstance(x, dict):
            trailing = " × ".join(str(n) for n in (x.get("shape") or [])[1:])
            words.append(f"{trailing} {x.get('dtype', '')}".strip())
        if isinstance(y, dict):
            words.append(f"→ {y.get('dtype', '')}")
        if d.get("kind") == "shards":
            words.append(f"({d.get('shards')} shards)")
        parts.append(" ".join(w for w in words if w))
    return ", ".join(parts)


def jobs_table(records: list[dict[str, Any]]) -> Any:
    """Job records as ``somatize jobs`` prints them: what each is (its name and job file), when
    it was submitted, how it stands and how long it took."""
    from rich.table import Table

    table = Table(title="jobs", title_justify="left")
    columns = ("id", "name", "file", "strategy", "state", "progress", "submitted", "took")
    for column in columns:
        # ids are copied from here: keep them whole; times too; a long path folds, never cut
        if column == "file":
            table.add_column(column, overflow="fold")
        else:
            table.add_column(column, no_wrap=column in ("id", "submitted"))
    now = time.time()
    for r in records:
        progress = r.get("progress")
        state = str(r.get("state", ""))
        if state == "failed" and isinstance(r.get("error"), dict):
            state = f"failed ({r['error'].get('code', '?')})"
        text = progress_text(progress) if isinstance(progress, dict) else ""
        summary = r.get("summary")
        summary = summary if isinstance(summary, dict) else {}
        if state == "queued" and not text and summary.get("placement"):
            text = f"waiting for {summary['placement']}"  # what it asked for
        if state == "queued" and isinstance(r.get("wait"), dict):
            text = " · ".join(filter(None, [text, wait_text(r["wait"])]))  # why it waits
        elif r.get("preempting"):
            text = f"leaving: preempted{' · ' + text if text else ''}"
        table.add_row(
            *cells(
                r.get("id", ""),
                summary.get("name") or "",
                summary.get("file") or "",
                r.get("strategy", ""),
                state,
                text,
                submitted_text(r.get("created"), now),
                duration_text(r, now),
            )
        )
    return table


def wait_text(wait: dict[str, Any]) -> str:
    """Where a queued job stands, in words: ``#2 share: 1 of clients further under their
    share first · starts in ~40s``."""
    said = f"#{wait.get('position', '?')} {wait.get('reason', '')}: {wait.get('detail', '')}"
    starts_in = wait.get("starts_in")
    if isinstance(starts_in, int | float):
        said += f" · starts in ~{starts_in:.0f}s"
    return said


def queue_table(records: list[dict[str, Any]]) -> Any:
    """The jobs running and queued as ``somatize queue`` prints them, in the order they go."""
    from rich.table import Table

    table = Table(title="queue", title_justify="left")
    for column in ("id", "client", "name", "priority", "state", "place", "why", "starts in"):
        table.add_column(column, no_wrap=column == "id")
    for r in records:
        summary: dict[str, Any] = r["summary"] if isinstance(r.get("summary"), dict) else {}
        wait: dict[str, Any] | None = r["wait"] if isinstance(r.get("wait"), dict) else None
        state = "leaving" if r.get("preempting") else str(r.get("state", ""))
        starts_in = None if wait is None else wait.get("starts_in")
        why = "" if wait is None else f"{wait.get('reason', '')}: {wait.get('detail', '')}"
        if wait is not None and wait.get("reason") == "no_worker" and summary.get("placement"):
            why += f" (it asks for {summary['placement']})"
        table.add_row(
            *cells(
                r.get("id", ""),
                summary.get("owner") or "",
                summary.get("name") or "",
                summary.get("priority", 0),
                state,
                "" if wait is None else f"#{wait.get('position', '?')}",
                why,
                f"~{starts_in:.0f}s" if isinstance(starts_in, int | float) else "",
            )
        )
    return table


def clients_table(clients: dict[str, Any]) -> Any:
    """Each client's share of the workers, as an admin's ``somatize queue`` prints them."""
    from rich.table import Table

    table = Table(title="clients", title_justify="left")
    for column in ("client", "share", "holds", "fair", "held lately"):
        table.add_column(column)
    for name, said in clients.items():
        said = said if isinstance(said, dict) else {}
        table.add_row(
            *cells(
                name,
                said.get("share", ""),
                said.get("holds", ""),
                said.get("fair", ""),
                said.get("recent", ""),
            )
        )
    return table


def submitted_text(created: Any, now: float) -> str:
    """When a job was submitted, in local time: ``14:03:27`` today, ``2026-11-30 14:03``
    before."""
    if not isinstance(created, int | float) or isinstance(created, bool):
        return ""
    at, today = time.localtime(created), time.localtime(now)
    same_day = at[:3] == today[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M", at)


def placed_text(data: dict[str, Any]) -> str:
    """A ``placed`` event in words: ``placed on w1 (cuda:0), w2 (cuda:1)``, and for
    DataParallel the collective: ``; gradients by torch (gloo)``."""
    workers = [str(w) for w in data.get("workers") or []]
    devices = data.get("devices")
    if isinstance(devices, list) and len(devices) == len(workers):
        workers = [f"{w} ({d})" for w, d in zip(workers, devices, strict=True)]
    text = f"placed on {', '.join(workers) or '?'}"
    collective = data.get("collective")
    if collective == "torch":
        text += f"; gradients by torch.distributed ({data.get('backend', '?')})"
    elif collective == "coordinator":
        text += f"; gradients through the coordinator: {data.get('collective_reason', '')}"
    return text


def queued_text(data: dict[str, Any]) -> str:
    """A ``queued`` event in words: ``queued: waiting for 2 workers tagged 'dp' (at most
    60 s)``."""
    needs, limit = data.get("placement"), data.get("wait_for_workers")
    text = f"queued: waiting for {needs}" if needs else "queued"
    return text + (f" (at most {limit:g} s)" if isinstance(limit, int | float) else "")


def replica_text(event: str, data: dict[str, Any]) -> str:
    """An elastic job's replica event, in a few words."""
    if event == "worker_lost":
        return f"lost worker {data.get('worker')} ({data.get('code')}); waiting for a replacement"
    return f"worker {data.get('worker')} replaces {data.get('lost')}"


def position_text(position: dict[str, Any]) -> str:
    """A checkpoint's position in words: ``step 40 (epoch 2)``, ``round 3``."""
    if "round" in position:
        return f"round {position['round']}"
    said = f"step {position.get('step', '?')}"
    return said + (f" (epoch {position['epoch']})" if "epoch" in position else "")


def progress_text(data: dict[str, Any]) -> str:
    """A job's last progress event in words (:func:`somatize.cli.progress.event_text`): ``epoch
    2/5 · step 7/12 · loss 0.5 (last step)``."""
    return event_text(data)


def duration_text(record: dict[str, Any], now: float) -> str:
    """How long a job ran (or has been running, or waiting, when it did not start)."""
    created, started, finished = (record.get(k) for k in ("created", "started", "finished"))
    if isinstance(started, int | float):
        end = finished if isinstance(finished, int | float) else now
        return f"{max(end - started, 0.0):.1f} s"
    if isinstance(created, int | float) and not isinstance(finished, int | float):
        return f"waiting {max(now - created, 0.0):.0f} s"
    return ""


def dtype_name(dtype: Any) -> str:
    """A numpy or torch dtype named one way: ``float32`` for ``numpy.float32`` and
    ``torch.float32`` alike."""
    return str(dtype).removeprefix("torch.")


def describe_state(state: Any, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """``(key, shape, dtype)`` of each leaf of a state (nested dicts and lists flattened)."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from describe_state(value, f"{prefix}.{key}" if prefix else str(key))
        return
    if isinstance(state, list | tuple):
        for i, value in enumerate(state):
            yield from describe_state(value, f"{prefix}[{i}]")
        return
    shape, dtype = getattr(state, "shape", None), getattr(state, "dtype", None)
    if shape is not None and dtype is not None:
        yield prefix, str(tuple(int(n) for n in shape)), dtype_name(dtype)
    else:
        text = repr(state)
        yield prefix, "", type(state).__name__ + (f" {text}" if len(text) <= 40 else "")


def states_summary(states: dict[str, Any]) -> str:
    """The states in one line: their nodes, how many tensors and numbers they hold and their
    bytes (``somatize result --states`` lists every tensor)."""
    tensors = numbers = nbytes = 0

    def count(value: Any) -> None:
        nonlocal tensors, numbers, nbytes
        if isinstance(value, dict):
            for item in value.values():
                count(item)
        elif isinstance(value, list | tuple):
            for item in value:
                count(item)
        elif (
            getattr(value, "shape", None) is not None and getattr(value, "dtype", None) is not None
        ):
            size = 1
            for n in value.shape:
                size *= int(n)
            tensors, numbers = tensors + 1, numbers + size
            nbytes += size * int(getattr(value.dtype, "itemsize", 0) or 0)

    count(states)
    nodes = listed(list(states), 6)
    held = f"{tensors} tensors, {numbers:,} numbers ({_bytes(nbytes)})" if tensors else "no tensors"
    plural = "" if len(states) == 1 else "s"
    return f"states of {len(states)} node{plural} {nodes}: {held}"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
