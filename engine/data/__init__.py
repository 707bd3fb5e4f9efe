"""Datasets the engine trains on, and the readers that fetch their rows.

A worker's own datasets (``somatize-worker --data NAME=PATH``) are opened without reading them
whole (:mod:`~engine.data.dataset_files`, :mod:`~engine.data.datasets`); a batch's rows are read
from disk as they are asked for (:mod:`~engine.data.npy_rows`, :mod:`~engine.data.row_reads`), or
from a map-style ``Dataset`` (:mod:`~engine.data.dataset_rows`), one batch ahead of training
(:mod:`~engine.data.read_ahead`).
"""
