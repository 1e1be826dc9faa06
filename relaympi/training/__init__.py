"""The training run shared by every backend: the resolved plan, one worker's loop, its
evaluation records and its checkpoints. ``relaympi.train`` is the command line around it."""
