"""A pipeline stage (ModelParallel): driven by the coordinator's calls, micro-batch by
micro-batch (:mod:`~engine.pipeline.stage`), or running its part of the schedule itself, its
activations sent straight to the next stage over torch.distributed
(:mod:`~engine.pipeline.linked_stage`). The coordinator's side is
:mod:`coordinator.strategies.model_parallel`.
"""
