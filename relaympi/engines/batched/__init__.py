"""The batched engine (``--backend batched``): every worker of a run as one stacked computation on
one device. run (the engine's run, its entry in relaympi.engines), models (all workers' models as
one parameter matrix, through torch.func), data (every worker's batch of a step, stacked). The
vectorized optimizers and algorithms it steps are relaympi.batched's."""
