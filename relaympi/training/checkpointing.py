"""A run's checkpoints, collectively: every rank saves its state, rank 0 names the complete step,
and a restart resumes only into the same run (same config, same world size, unfinished file)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relaympi import checkpoint
from relaympi.config import ConfigError, RunConfig
from relaympi.results import FINISHED_STATUSES, RESUMABLE_STATUSES, run_status

log = logging.getLogger("relaympi.train")

# config keys that may differ between a run and its resumption: where output goes and how the
# work is spread over processes, threads and devices
_RESUME_FREE_KEYS = ("out", "overwrite", "checkpoint_dir", "backend", "workers", "log_every", "threads", "loader_workers", "device", "eval_batch_size")


_MESSAGE_PASSING = "message passing (backend local or mpi)"


def resume_key(cfg: RunConfig) -> dict[str, Any]:
    """The config fields that must match for a checkpoint to be resumed."""
    d = cfg.to_dict()
    for key in _RESUME_FREE_KEYS:
        d.pop(key, None)
    return d


class Checkpoints:
    """One process's view of the run's checkpoint directory (None: the run keeps no checkpoints).

    ``barrier`` synchronizes the processes of a message-passing run. ``engine`` names an engine
    whose checkpoints the others cannot read (the batched engine keeps every worker in one file);
    None is message passing, whose checkpoints any backend of it resumes.
    """

    def __init__(self, cfg: RunConfig, out: Path, rank: int, world_size: int, barrier: Callable[[], None] | None = None, engine: str | None = None):
        self.cfg, self.out, self.rank, self.world_size = cfg, out, rank, world_size
        self.barrier = barrier or (lambda: None)
        self.engine = engine
        self.directory = cfg.checkpoint_dir

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Collective: every rank writes ``state``; meta.json names the step once all have."""
        checkpoint.save(self.directory, self.rank, step, state)
        self.barrier()
        if self.rank == 0:
            engine = {"engine": self.engine} if self.engine else {}
            checkpoint.write_meta(self.directory, {"step": step, "world_size": self.world_size, **engine, "config": resume_key(self.cfg)})
        self.barrier()
        checkpoint.prune(self.directory, self.rank, step)

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
        n = self.world_size
        saved, current = meta.get("config") or {}, resume_key(self.cfg)
        differences = []
        if meta.get("engine") != self.engine:
            differences.append(f"engine {meta.get('engine') or _MESSAGE_PASSING} vs {self.engine or _MESSAGE_PASSING}")
        if meta.get("world_size") != n:
            differences.append(f"world size {meta.get('world_size')} vs {n}")
        differences += [f"{k} {saved.get(k)!r} vs {current.get(k)!r}" for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
        if differences:
            raise ConfigError(
                f"checkpoint in {self.directory} belongs to a different run (checkpoint vs this command: {'; '.join(differences)}); "
                "use another --checkpoint-dir or delete it"
            )
        step = int(meta["step"])
        return step, checkpoint.load(self.directory, self.rank, step)
