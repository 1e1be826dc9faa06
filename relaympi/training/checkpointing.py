"""A run's checkpoints, collectively: every rank saves its state, rank 0 names the complete step,
and a restart resumes only into the same run (the run file the checkpoint names, unfinished, whose
evaluations reach the checkpoint's step; same config, same world size)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relaympi.algorithms.registry import communication
from relaympi.config import RESUME_FREE_KEYS, ConfigError, RunConfig
from relaympi.results import (
    FINISHED_STATUSES,
    RESUMABLE_STATUSES,
    RunFileError,
    read_run,
    run_status,
)
from relaympi.training import checkpoint_files

log = logging.getLogger("relaympi.train")

_MESSAGE_PASSING = "message passing (backend local or mpi)"


def resume_key(cfg: RunConfig) -> dict[str, Any]:
    """The config fields that must match for a checkpoint to be resumed (all but
    config.RESUME_FREE_KEYS)."""
    d = cfg.to_dict()
    for key in RESUME_FREE_KEYS:
        d.pop(key, None)
    return d


class Checkpoints:
    """One process's view of the run's checkpoint directory (None: the run keeps no checkpoints).

    ``barrier`` synchronizes the processes of a message-passing run. ``engine`` names an engine
    whose checkpoints the others cannot read (the batched engine keeps every worker in one file);
    None is message passing, whose checkpoints any backend of it resumes.
    """

    def __init__(
        self,
        cfg: RunConfig,
        out: Path,
        rank: int,
        world_size: int,
        barrier: Callable[[], None] | None = None,
        engine: str | None = None,
        nodes: Sequence[int] = (),
    ):
        self.cfg, self.out, self.rank, self.world_size = cfg, out, rank, world_size
        self.barrier = barrier or (lambda: None)
        self.engine = engine
        # placed by node, the trees follow the nodes, and so does the all-reduce's tree (its stage
        # order; its declared communication follows the nodes): a resume must find the ranks on the
        # same nodes
        self.nodes = (
            [int(node) for node in nodes]
            if cfg.placement == "nodes" or communication(cfg.algo).follows_nodes
            else None
        )
        self.directory = cfg.checkpoint_dir
        self.owner: dict[str, Any] = {}  # rank 0: the run file this run writes (see claim())
        # after a lost worker (--on-failure continue): each rank still saves under its first rank
        # (its id), the lowest survivor names the step, and meta.json lists the survivors
        self.writes_meta = rank == 0
        self.members: list[int] | None = None
        # load(): the workers a checkpoint saved after a loss lacks, re-admitted by this rerun
        self.readmitting: list[int] = []

    def heal(self, rank: int, barrier: Callable[[], None], members: list[int]) -> None:
        """Checkpoints of the survivors: ``rank`` in the new membership, its barrier, the ids of
        the survivors (rank order); the run's nodes stay its first ones (a rerun's)."""
        self.writes_meta, self.barrier, self.members = rank == 0, barrier, list(members)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Collective: every rank writes ``state``; meta.json names the step once all have."""
        assert self.directory is not None  # called only where checkpointing is enabled
        checkpoint_files.save(self.directory, self.rank, step, state)
        self.barrier()
        if self.writes_meta:
            engine = {"engine": self.engine} if self.engine else {}
            nodes = {"nodes": self.nodes} if self.nodes is not None else {}
            meta = {
                "step": step,
                "world_size": self.world_size,
                **engine,
                **nodes,
                **({"members": self.members} if self.members is not None else {}),
                "config": resume_key(self.cfg),
                "owner": self.owner,
            }
            checkpoint_files.write_meta(self.directory, meta)
        self.barrier()
        checkpoint_files.prune(self.directory, self.rank, step)

    # -- a folder every node sees ------------------------------------------------------------
    _HOST_MARK = ".host-{}"  # one per node: written by its ranks, read by rank 0

    def mark_host(self, host: str) -> None:
        """Every rank: leave this node's mark in the folder (collective with check_shared)."""
        assert self.directory is not None  # called only where checkpointing is enabled
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / self._HOST_MARK.format(host)).touch()

    def check_shared(self, hosts: list[str]) -> None:
        """Rank 0, after every rank's mark_host: refuse a folder that some node's ranks write
        where rank 0 cannot read (each node's own disk): a resume there would mix steps."""
        assert self.directory is not None  # called only where checkpointing is enabled
        missing = sorted(
            {h for h in hosts if not (self.directory / self._HOST_MARK.format(h)).exists()}
        )
        for host in set(hosts) - set(missing):
            (self.directory / self._HOST_MARK.format(host)).unlink(missing_ok=True)
        if missing:
            raise ConfigError(
                f"--checkpoint-dir {self.directory} is not shared between the run's "
                f"nodes: rank 0 on {hosts[0]} cannot see "
                f"what the ranks on {', '.join(missing)} write there; give a folder on a "
                "filesystem every node mounts "
                "(e.g. under $HOME or the cluster's shared scratch), not a node-local "
                "disk such as /tmp"
            )

    def claim(self, run_id: str | None) -> None:
        """Rank 0, once the run file is open: the checkpoints it saves belong to that file (its path
        and run_id)."""
        self.owner = {"out": str(Path(self.out).resolve()), "run_id": run_id}

    def resumable(self, eval_every: int) -> bool:
        """Rank 0: whether to resume from the checkpoint in the directory.

        A checkpoint belongs to the run file it names: another run refuses it (ConfigError) unless
        --overwrite discards it. It resumes only into that unfinished file, and only when the file's
        evaluations reach its step (every ``eval_every`` steps), so that the file has no gap.
        """
        if self.directory is None:
            return False
        meta = checkpoint_files.read_meta(self.directory)
        if meta is None:
            return False
        step, owner = int(meta["step"]), meta.get("owner") or {}
        out = Path(self.out)
        if owner.get("out") and owner["out"] != str(out.resolve()):
            return self._refuse(
                f"--checkpoint-dir {self.directory} holds the checkpoint (step {step}) of "
                "another run, the one writing "
                f"{owner['out']}; give this run its own --checkpoint-dir (or resume that "
                "run with its --out)"
            )
        status = run_status(out)
        if status in FINISHED_STATUSES and not self.cfg.overwrite:
            return False  # the writer refuses the finished file with a clear message
        if status not in RESUMABLE_STATUSES:
            if status == "missing":
                log.warning(
                    "ignoring the checkpoint in %s: %s is missing, so the run starts from step 0",
                    self.directory,
                    out,
                )
            else:
                log.warning(
                    "discarding the checkpoint in %s: %s is %s and --overwrite replaces "
                    "it, so the run starts from step 0",
                    self.directory,
                    out,
                    status,
                )
            checkpoint_files.forget(self.directory)
            return False
        try:
            run = read_run(out, datasets=["step"])
        except RunFileError as exc:
            return self._refuse(f"cannot resume into {out}: {exc.reason}")
        if owner.get("run_id") and run.attrs.get("run_id") != owner["run_id"]:
            return self._refuse(
                f"the checkpoint in {self.directory} (step {step}) was saved by another "
                f"run than the one in {out} "
                f"(run_id {owner['run_id']} vs {run.attrs.get('run_id')})"
            )
        steps = run.data.get("step")
        last = int(steps[-1]) if steps is not None and len(steps) else None
        # the last evaluation before the checkpoint's step
        needed = (step - 1) // eval_every * eval_every if step > 0 else 0
        if last is None or last < needed:
            at = f"end at step {last}" if last is not None else "are empty"
            return self._refuse(
                f"the checkpoint in {self.directory} is of step {step}, but the "
                f"evaluations in {out} {at} "
                f"(step {needed} is missing): resuming would leave a gap in the run file"
            )
        return True

    def _refuse(self, reason: str) -> bool:
        """A checkpoint that cannot resume this run: an error, or with --overwrite discarded (the
        run starts from step 0)."""
        assert self.directory is not None  # called only where checkpointing is enabled
        if not self.cfg.overwrite:
            raise ConfigError(
                f"{reason}; or pass --overwrite to discard the checkpoint and start this "
                "run from step 0"
            )
        log.warning("discarding the checkpoint in %s (--overwrite): %s", self.directory, reason)
        checkpoint_files.forget(self.directory)
        return False

    def load(self) -> tuple[int, dict[str, Any] | None]:
        """(step, this rank's state) of the checkpoint meta.json names; (0, None) when there is
        none."""
        if self.directory is None:
            return 0, None
        meta = checkpoint_files.read_meta(self.directory)
        if meta is None:
            return 0, None
        n = self.world_size
        saved, current = meta.get("config") or {}, resume_key(self.cfg)
        differences = []
        if meta.get("engine") != self.engine:
            differences.append(
                f"engine {meta.get('engine') or _MESSAGE_PASSING} vs "
                f"{self.engine or _MESSAGE_PASSING}"
            )
        members = meta.get("members")
        if meta.get("world_size") != n:
            survivors = f" (or its {len(members)} survivors)" if members is not None else ""
            differences.append(f"world size {meta.get('world_size')}{survivors} vs {n}")
        elif (
            meta.get("nodes") is not None and self.nodes is not None and meta["nodes"] != self.nodes
        ):
            differences.append(
                f"each rank's node {meta['nodes']} vs {self.nodes} (--placement nodes "
                "builds the trees from them, --algo allreduce the order of its sum)"
            )
        differences += [
            f"{k} {saved.get(k)!r} vs {current.get(k)!r}"
            for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)
        ]
        if differences:
            raise ConfigError(
                f"checkpoint in {self.directory} belongs to a different run (checkpoint "
                f"vs this command: {'; '.join(differences)}); "
                "use another --checkpoint-dir or delete it"
            )
        step = int(meta["step"])
        running = self.members if self.members is not None else list(range(n))
        if members is not None and members != running:
            # saved after a loss, resumed on the run's first count: the lost are re-admitted
            self.readmitting = sorted(set(running) - set(members))
            if self.rank not in members:
                return step, None
        return step, checkpoint_files.load(self.directory, self.rank, step)
