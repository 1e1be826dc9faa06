"""A run's checkpoints, collectively: every rank saves its state, rank 0 names the complete step,
and a restart resumes only into the same run (same config, same world size, unfinished file)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from relaympi import checkpoint
from relaympi.comm import Communicator
from relaympi.config import ConfigError, RunConfig
from relaympi.results import FINISHED_STATUSES, RESUMABLE_STATUSES, run_status

log = logging.getLogger("relaympi.train")

# config keys that may differ between a run and its resumption: where output goes and how the
# work is spread over processes, threads and devices
_RESUME_FREE_KEYS = ("out", "overwrite", "checkpoint_dir", "backend", "workers", "log_every", "threads", "loader_workers", "device", "eval_batch_size")


def resume_key(cfg: RunConfig) -> dict[str, Any]:
    """The config fields that must match for a checkpoint to be resumed."""
    d = cfg.to_dict()
    for key in _RESUME_FREE_KEYS:
        d.pop(key, None)
    return d


class Checkpoints:
    """One rank's view of the run's checkpoint directory (None: the run keeps no checkpoints)."""

    def __init__(self, comm: Communicator, cfg: RunConfig, out: Path):
        self.comm, self.cfg, self.out = comm, cfg, out
        self.directory = cfg.checkpoint_dir

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Collective: every rank writes ``state``; meta.json names the step once all have."""
        checkpoint.save(self.directory, self.comm.rank, step, state)
        self.comm.barrier()
        if self.comm.rank == 0:
            checkpoint.write_meta(self.directory, {"step": step, "world_size": self.comm.world_size, "config": resume_key(self.cfg)})
        self.comm.barrier()
        checkpoint.prune(self.directory, self.comm.rank, step)

    def resumable(self) -> bool:
        """Rank 0: resume only into this run's own unfinished file; otherwise forget a stale checkpoint."""
        if self.directory is None or checkpoint.read_meta(self.directory) is None:
            return False
        status = run_status(self.out)
        if status in RESUMABLE_STATUSES:
            return True
        if status in FINISHED_STATUSES and not self.cfg.overwrite:
            return False  # the writer refuses the finished file with a clear message
        log.warning("ignoring the checkpoint in %s: %s is %s, so the run starts from step 0", self.directory, self.out, status)
        checkpoint.forget(self.directory)
        return False

    def load(self) -> tuple[int, dict[str, Any] | None]:
        """(step, this rank's state) of the checkpoint meta.json names; (0, None) when there is none."""
        if self.directory is None:
            return 0, None
        meta = checkpoint.read_meta(self.directory)
        if meta is None:
            return 0, None
        n = self.comm.world_size
        saved, current = meta.get("config") or {}, resume_key(self.cfg)
        if meta.get("world_size") != n or saved != current:
            differences = [f"world size {meta.get('world_size')} vs {n}"] if meta.get("world_size") != n else []
            differences += [f"{k} {saved.get(k)!r} vs {current.get(k)!r}" for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
            raise ConfigError(
                f"checkpoint in {self.directory} belongs to a different run (checkpoint vs this command: {'; '.join(differences)}); "
                "use another --checkpoint-dir or delete it"
            )
        step = int(meta["step"])
        return step, checkpoint.load(self.directory, self.comm.rank, step)
