"""What ``--replay-drops RUN.h5`` replays: the late drops, skipped steps and losses an MPI run
recorded, read from its run file once that file is checked against the run replaying it."""

from __future__ import annotations

from relaympi.config import ConfigError, RunConfig
from relaympi.results import RunFileError
from relaympi.results.bounded import read_run_bounded


def replayed_late_drops(cfg: RunConfig, world_size: int) -> list[tuple[int, int, int, int]]:
    """The late drops ``--replay-drops`` replays: the (round, tag, sender, receiver) of each
    message its run file recorded as late, once that file is checked against this run.

    Args:
        cfg: the run's configuration, its topology resolved.
        world_size: the run's number of workers.

    Returns:
        The late drops ([] without --replay-drops).

    Raises:
        ConfigError: as ``replayed``.
    """
    return replayed(cfg, world_size)[0]


def replayed(
    cfg: RunConfig, world_size: int
) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """What ``--replay-drops`` replays, once its run file is checked against this run: the (round,
    tag, sender, receiver) of each message it recorded as late, the (step, worker) of each step a
    worker skipped to catch up, and the (step, worker) of each worker it lost (original ids).

    Args:
        cfg: the run's configuration, its topology resolved.
        world_size: the run's number of workers.

    Returns:
        The late drops, the skipped steps and the losses (all [] without --replay-drops).

    Raises:
        ConfigError: the file cannot be read, is not a --message-deadline run, or ran another
            world size, algorithm or topology, or lost workers; one line naming what differs.
    """
    if cfg.replay_drops is None:
        return [], [], []
    flag = f"--replay-drops {cfg.replay_drops}"
    try:
        # a run file may come from anyone: read in a worker process under a time and memory limit
        run = read_run_bounded(cfg.replay_drops, datasets=[])
    except RunFileError as exc:
        raise ConfigError(f"{flag}: {exc.reason}") from None
    if run.late_drops is None:
        raise ConfigError(f"{flag}: it records no late drops (not a --message-deadline run)")
    theirs = {
        "world size": run.world_size,
        "--algo": run.config.get("algo"),
        "--topology": run.config.get("topology"),
    }
    ours = {"world size": world_size, "--algo": cfg.algo, "--topology": cfg.topology}
    for what, value in theirs.items():
        if value != ours[what]:
            raise ConfigError(
                f"{flag}: it ran {what} {value}, this run has {ours[what]}; replay it with the "
                "same world size, algorithm and topology"
            )
    losses = []
    for change in run.membership:
        if change.get("readmitted"):
            raise ConfigError(
                f"{flag}: it re-admitted lost workers (a rerun), and replaying a re-admission is "
                "not supported"
            )
        losses += [(int(change["step"]), int(worker)) for worker in change.get("lost", [])]
    if losses and (cfg.on_failure != "continue" or cfg.backend != "local"):
        raise ConfigError(
            f"{flag}: it lost {len(losses)} workers mid-run; replay its losses with "
            "--backend local --on-failure continue"
        )
    late = [(int(r), int(t), int(s), int(d)) for _, r, t, s, d in run.late_drops]
    skipped = [] if run.skipped_steps is None else [(int(t), int(w)) for t, w in run.skipped_steps]
    if skipped and cfg.backend == "batched":
        raise ConfigError(
            f"{flag}: its workers skipped {len(skipped)} steps to catch up, which only "
            "--backend local replays (the batched engine steps every worker at every step)"
        )
    return late, skipped, losses
