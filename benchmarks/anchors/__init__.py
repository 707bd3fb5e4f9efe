"""Anchors: torch's own way of doing what a top-level benchmark measures, run in plain processes
over gloo with no coordinator, worker or daemon, on the same model, data and seed.
:mod:`~benchmarks.anchors.pipelining` is ``torch.distributed.pipelining``'s schedules for
:mod:`benchmarks.pipeline`; :mod:`~benchmarks.anchors.fsdp_memory` is ``fully_shard`` (FSDP2)
and what it holds per rank, for :mod:`benchmarks.sharded_memory`. A benchmark that is a folder
keeps its anchors beside it (:mod:`benchmarks.slow_links.anchors`,
:mod:`benchmarks.federated.flower_anchor`), and the smaller anchors live in their benchmark's
own module (gloo's all-reduce in :mod:`benchmarks.allreduce`, DDP in
:mod:`benchmarks.data_parallel`)."""
