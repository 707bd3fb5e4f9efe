"""Prometheus text for ``GET /metrics``: workers and jobs by state, bytes, command latencies."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

from protocol.asyncio.channel import Channel

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 600.0)
"""Upper bounds (seconds) of the worker-command latency histogram."""


class Metrics:
    """Counters kept by the coordinator; rendering reads the live state it is given."""

    def __init__(self) -> None:
        self.retired_in = 0
        self.retired_out = 0
        self.retired_busy = 0
        self.relayed = 0  # payload bytes of tensors relayed between workers
        self.refused_upgrades = 0  # upgrades answered 503: too many connections without a hello
        self._latency: dict[str, list[int]] = {}
        self._latency_sum: dict[str, float] = {}

    def observe(self, cmd: str, seconds: float) -> None:
        """One worker command of a job took ``seconds`` (round trip, as the strategy saw it)."""
        counts = self._latency.setdefault(cmd, [0] * (len(BUCKETS) + 1))
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._latency_sum[cmd] = self._latency_sum.get(cmd, 0.0) + seconds

    def retire(self, channel: Channel) -> None:
        """Keep the byte counts of a connection that ended."""
        self.retired_in += channel.bytes_in
        self.retired_out += channel.bytes_out
        self.retired_busy += channel.refused_busy

    def render(
        self,
        workers: Mapping[str, int],
        jobs: Mapping[str, int],
        channels: Iterable[Channel],
        pending: int = 0,
        refused_at_accept: int = 0,
        displaced_pending: int = 0,
    ) -> str:
        live = list(channels)
        lines = [
            "# HELP somatize_workers Workers known to the coordinator, by state.",
            "# TYPE somatize_workers gauge",
            *(f'somatize_workers{{state="{s}"}} {n}' for s, n in workers.items()),
            "# HELP somatize_jobs Jobs in the store, by state.",
            "# TYPE somatize_jobs gauge",
            *(f'somatize_jobs{{state="{s}"}} {n}' for s, n in jobs.items()),
            "# HELP somatize_connections Open WebSocket connections.",
            "# TYPE somatize_connections gauge",
            f"somatize_connections {len(live)}",
            "# HELP somatize_pending_connections Connections that have not completed their hello.",
            "# TYPE somatize_pending_connections gauge",
            f"somatize_pending_connections {pending}",
            "# HELP somatize_refused_upgrades_total Upgrades refused (503): too many pending.",
            "# TYPE somatize_refused_upgrades_total counter",
            f"somatize_refused_upgrades_total {self.refused_upgrades}",
            "# HELP somatize_refused_accepts_total Sockets closed at accept: their address "
            "held its share of pending sockets, each with a token shown.",
            "# TYPE somatize_refused_accepts_total counter",
            f"somatize_refused_accepts_total {refused_at_accept}",
            "# HELP somatize_displaced_pending_total Pending sockets without a token closed to "
            "make room for a newer one from their address.",
            "# TYPE somatize_displaced_pending_total counter",
            f"somatize_displaced_pending_total {displaced_pending}",
            "# HELP somatize_busy_refusals_total Requests refused: too many in flight.",
            "# TYPE somatize_busy_refusals_total counter",
            f"somatize_busy_refusals_total {self.retired_busy + sum(c.refused_busy for c in live)}",
            "# HELP somatize_received_bytes_total Bytes received in messages.",
            "# TYPE somatize_received_bytes_total counter",
            f"somatize_received_bytes_total {self.retired_in + sum(c.bytes_in for c in live)}",
            "# HELP somatize_sent_bytes_total Bytes sent in messages.",
            "# TYPE somatize_sent_bytes_total counter",
            f"somatize_sent_bytes_total {self.retired_out + sum(c.bytes_out for c in live)}",
            "# HELP somatize_relayed_bytes_total Tensor bytes relayed between workers.",
            "# TYPE somatize_relayed_bytes_total counter",
            f"somatize_relayed_bytes_total {self.relayed}",
            "# HELP somatize_worker_call_seconds Round trip of job commands on workers; "
            "cmd=mean_streamed|mean_whole: a DataParallel step through the coordinator, from "
            "its requests to its gradient mean whole (folded as the replies arrived, or not).",
            "# TYPE somatize_worker_call_seconds histogram",
        ]
        for cmd, counts in sorted(self._latency.items()):
            running = 0
            for bound, count in zip((*BUCKETS, float("inf")), counts, strict=True):
                running += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(
                    f'somatize_worker_call_seconds_bucket{{cmd="{cmd}",le="{le}"}} {running}'
                )
            lines.append(
                f'somatize_worker_call_seconds_sum{{cmd="{cmd}"}} {self._latency_sum[cmd]}'
            )
            lines.append(f'somatize_worker_call_seconds_count{{cmd="{cmd}"}} {running}')
        return "\n".join(lines) + "\n"
