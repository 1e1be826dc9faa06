"""The run file of a training run: rank 0 creates (or reopens) it, and the command prints its
summary."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from relaympi import provenance
from relaympi.config import ConfigError
from relaympi.results import (
    CHANCE_FACTOR,
    PROBLEM_DIGEST_ATTR,
    RESUMABLE_STATUSES,
    NotARunFileError,
    RunExistsError,
    RunFileWriteError,
    RunTopology,
    RunWriter,
    read_run,
    run_status,
    summary_text,
    unstable_loss,
    unstable_text,
    workers_at_chance,
)
from relaympi.results.quality import CHANCE_AFTER_EPOCHS
from relaympi.results.schema import ADDED_DATASETS, QUADRATICS_CONVENTION_ATTR
from relaympi.results.text import one_line
from relaympi.tasks.quadratics import CONVENTION
from relaympi.training.checkpoint_files import CheckpointWriteError
from relaympi.training.plan import Plan

log = logging.getLogger("relaympi.train")


# a run that could not write its files (a full disk): a one-line reason, no traceback
WRITE_ERRORS = (RunFileWriteError, CheckpointWriteError)


def record_failure(writer: RunWriter, exc: BaseException) -> None:
    """Set the run file's status to failed with the error (and its traceback, unless it is a write
    error)."""
    import traceback

    extra = {} if isinstance(exc, WRITE_ERRORS) else {"traceback": traceback.format_exc()[-20000:]}
    try:
        writer.set_status("failed", error=f"{type(exc).__name__}: {exc}", **extra)
    except RunFileWriteError as again:
        log.error("could not record the failure in the run file: %s", again)


def close_quietly(writer: RunWriter) -> None:
    """Close the run file; a failure to (the disk is full) is logged, not raised over the run's own
    error."""
    try:
        writer.close()
    except RunFileWriteError as exc:
        log.error("%s", exc)


def writer_factory(plan: Plan, out: Path, command: str) -> Any:
    """Rank 0's run file: reopened to resume an unfinished run, else created."""

    def make(
        start_step: int, hosts: list[str], transport: dict[str, Any], total_steps: int
    ) -> RunWriter:
        try:
            if start_step > 0 and run_status(out) in RESUMABLE_STATUSES:
                writer = RunWriter.reopen(out, resume_step=start_step - 1)
                writer.leave_out_if_absent(ADDED_DATASETS)
                return writer
            out.parent.mkdir(parents=True, exist_ok=True)  # only now: a refused run writes nothing
            writer = RunWriter.create(
                out,
                config=plan.cfg.to_dict()
                | {
                    "world_size": plan.world_size,
                    "lr_effective": plan.lr,
                    "total_steps": total_steps,
                },
                provenance=provenance.collect(transport, hosts, command=command),
                world_size=plan.world_size,
                overwrite=plan.cfg.overwrite,
            )
            writer.set_topology(run_topology(plan))
            if plan.problem is not None:  # quadratics: the problem, however it was made
                writer.set_attrs(
                    **{
                        PROBLEM_DIGEST_ATTR: plan.problem.digest(),
                        QUADRATICS_CONVENTION_ATTR: CONVENTION,
                    }
                )
            return writer
        except NotARunFileError as exc:
            raise ConfigError(
                f"--out {exc}; --out replaces only run files: choose another --out"
            ) from exc
        except RunFileWriteError:
            raise  # a full disk is a failure of the run, not a usage error
        except RunExistsError as exc:
            raise ConfigError(
                f"{out} already holds a finished run; pass --overwrite to replace it"
            ) from exc
        except OSError as exc:
            # a live run holds HDF5's lock: RunWriter.create probes it (RunInUseError, a
            # BlockingIOError) before
            # h5py would truncate the file; reopen fails on the lock without writing
            if isinstance(exc, BlockingIOError) or "lock" in str(exc).lower():
                raise ConfigError(
                    f"{out} is being written by another run; give this run another --out, "
                    "or wait for that one to end"
                ) from exc
            raise ConfigError(
                f"cannot write the run file --out {out}: {exc}; choose a writable path"
            ) from exc

    return make


def run_topology(plan: Plan) -> RunTopology:
    """What the run file records of the plan's topology: each rank's node and every layer's
    edges."""
    topology = plan.topology
    nodes = plan.nodes or (0,) * plan.world_size
    return RunTopology(
        name=topology.name,
        placement=plan.cfg.placement,
        rank_node=np.asarray(nodes, dtype=np.int64),
        nodes_emulated=plan.cfg.ranks_per_node is not None,
        edges=tuple(topology.edge_array(layer) for layer in range(topology.num_layers)),
        inter_node_edges=tuple(int(count) for count in topology.inter_node_edges(nodes)),
    )


def topology_text(topology: RunTopology | None) -> str:
    """' | placement nodes (2 emulated nodes)': the placement the run used (nothing for older
    files)."""
    if topology is None:
        return ""
    emulated = (
        f" ({topology.num_nodes} emulated node{'s' if topology.num_nodes != 1 else ''})"
        if topology.nodes_emulated
        else ""
    )
    return f" | placement {topology.placement}{emulated}"


def placement_text(world_size: Any, provenance: dict[str, Any]) -> str:
    """' | 16 workers on 4 nodes' (nothing where the run file does not say)."""
    nodes = provenance.get("nodes")
    if not world_size or not nodes:
        return ""
    return (
        f" | {int(world_size)} worker{'s' if int(world_size) != 1 else ''} on {nodes} "
        f"node{'s' if nodes != 1 else ''}"
    )


def print_summary(out: Path, status: str, checkpoint_dir: Path | None = None) -> None:
    """The line a finished command prints: where the run file is and its final metrics (a stopped
    run: where it stopped and whether the same command resumes it)."""
    try:
        run = read_run(out)
    except Exception:  # noqa: BLE001 - a summary must never turn success into failure
        log.info("%s: %s", status, out)
        return
    line = f"{status}: {out}"
    if status == "preempted":
        at = run.attrs.get("stopped_step", "?")
        line += (
            f" | stopped at step {at}; checkpoint saved in {checkpoint_dir}: run the same "
            "command again to resume"
            if checkpoint_dir is not None
            else f" | stopped at step {at}; no checkpoint (no --checkpoint-dir): a rerun "
            "starts over"
        )
    # only a completed run has a final model; otherwise say where it stopped
    steps = run.data.get("step")
    at = (
        f"at step {int(steps[-1])} (not final: {status})"
        if steps is not None and len(steps)
        else f"(not final: {status})"
    )
    final = {"test": "final test accuracy", "sub": "final suboptimality"}
    if status != "completed":
        final = {"test": f"test accuracy {at}", "sub": f"suboptimality {at}"}
    # with membership changes, the metrics are over the workers that finished: a lost worker's
    # columns are NaN by design; a NaN of a worker that finished still shows (as nan)
    finished: Any = run.finished_workers if run.membership else slice(None)
    if "test_accuracy" in run.data and len(run.data["test_accuracy"]):
        acc = run.data["test_accuracy"][-1][finished]
        line += (
            f" | {final['test']}: worst worker {np.min(acc):.4f}, mean {np.mean(acc):.4f}, "
            f"best {np.max(acc):.4f}"
        )
        epoch = run.data["epoch"]
        # the paper's last-5-epochs window, as the report uses it
        window = (epoch > epoch[-1] - 5) & (epoch > 0)
        if window.any():
            acc = run.data["test_accuracy"][window][:, finished]
            if run.membership:  # a re-admitted worker's rows while it was out do not count
                was_in = run.present()[window][:, finished]
                acc = np.where(was_in, acc, 0.0).sum(axis=0) / was_in.sum(axis=0)
            else:
                acc = acc.mean(axis=0)
            line += (
                f" | last 5 epochs (paper metric): worst worker {acc.min():.4f}, mean "
                f"{acc.mean():.4f}"
            )
        num_classes = run.attrs.get("num_classes")
        # judged only after some training: any model is near chance before (step 0 is untrained)
        trained = float(run.data["epoch"][-1]) >= CHANCE_AFTER_EPOCHS
        chance = workers_at_chance(acc, num_classes) if trained else []
        if run.membership:  # the workers' original ids
            chance = [finished[w] for w in chance]
        if chance:
            assert num_classes is not None  # none are at chance without a number of classes
            line += (
                f" | WARNING: worker(s) {', '.join(map(str, chance))} at chance accuracy "
                f"(< {CHANCE_FACTOR / num_classes:.0%}); "
                "check the learning rate (the defaults were tuned for 16 workers)"
            )
    if "suboptimality" in run.data and len(run.data["suboptimality"]):
        line += f" | {final['sub']} {run.data['suboptimality'][-1]:.3e}"
    if run.membership:
        line += f" | {summary_text(run.world_size, run.membership)}"
    line += placement_text(run.attrs.get("world_size"), run.provenance) + topology_text(
        run.topology
    )
    if run.config.get(
        "overlap"
    ):  # the default across nodes: say so, it sets the timers' meaning (docs/overlap.md)
        # False where MPI lacked THREAD_MULTIPLE
        ran = run.provenance.get("transport_progress_thread", run.config.get("progress_thread"))
        line += " | overlap" + (" with a progress thread" if ran else "")
    unstable = (
        unstable_loss(run.data["train_loss"], run.present() if run.membership else None)
        if "train_loss" in run.data
        else None
    )
    if unstable:
        line += f" | WARNING: {unstable_text(unstable)}"
    print(one_line(line), flush=True)  # the file's strings as text: no line break or escape
