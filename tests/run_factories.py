"""Hand-made run files for tests and benchmarks: known curves, and broken files of every kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
from numpy.typing import ArrayLike

from relaympi.results import RunWriter
from relaympi.results.schema import QUADRATICS_CONVENTION_ATTR
from relaympi.tasks.quadratics import CONVENTION

BASE_CONFIG: dict[str, Any] = {
    "task": "cifar10",
    "algo": "relay",
    "topology": "double-binary-trees",
    "alpha": 0.1,
    "lr": 0.1,
    "momentum": 0.0,
    "optimizer": "sgd",
    "world_size": 4,
    "seed": 0,
    "drop_prob": 0.0,
    "epochs": 10,
    "steps": None,
    "batch_size": 32,
    "relay_mode": None,
}


def make_config(**overrides: Any) -> dict[str, Any]:
    config = dict(BASE_CONFIG)
    config.update(overrides)
    return config


def write_classification_run(
    path: Path,
    accuracy: np.ndarray,
    epochs: np.ndarray | None = None,
    *,
    status: str = "completed",
    diverged_epoch: float | None = None,
    train_loss: np.ndarray | None = None,
    costs: dict[str, np.ndarray] | None = None,
    provenance: dict[str, Any] | None = None,
    **config: Any,
) -> Path:
    """A run whose test_accuracy is ``accuracy`` [evals, workers] at ``epochs`` (default 1..evals),
    and train_loss ``train_loss`` [evals, workers] (default: 1/k at the k-th evaluation).

    ``costs``: further datasets by name (``time_s`` [evals] replaces the default 0, 1, 2, ...;
    ``time_compute_s``, ``time_comm_s``, ``time_sync_s``, ``time_eval_s``, ``bytes_sent``,
    ``inter_node_bytes_sent`` [evals, workers], cumulative); ``provenance`` replaces the
    factory's."""
    accuracy = np.asarray(accuracy, dtype=float)
    evals, workers = accuracy.shape
    epochs = (
        np.arange(1, evals + 1, dtype=float) if epochs is None else np.asarray(epochs, dtype=float)
    )
    config = make_config(world_size=workers, **config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with RunWriter.create(
        path,
        config=config,
        provenance=provenance or {"factory": "tests"},
        world_size=workers,
        overwrite=True,
    ) as writer:
        writer.extend(
            {
                **{name: np.asarray(values, dtype=float) for name, values in (costs or {}).items()},
                "step": np.round(epochs * 100).astype(np.int64),
                "epoch": epochs,
                "time_s": np.asarray((costs or {}).get("time_s", np.arange(evals)), dtype=float),
                "train_loss": np.repeat(1.0 / np.arange(1, evals + 1), workers).reshape(
                    evals, workers
                )
                if train_loss is None
                else np.asarray(train_loss, dtype=float),
                "test_accuracy": accuracy,
            }
        )
        if status == "diverged":
            writer.set_status(
                "diverged",
                diverged_epoch=float(diverged_epoch if diverged_epoch is not None else epochs[-1]),
                diverged_step=int(round(epochs[-1] * 100)),
            )
        elif status != "running":
            writer.set_status(status)
    return path


def write_quadratics_run(
    path: Path,
    suboptimality: ArrayLike,
    steps: np.ndarray | None = None,
    *,
    status: str = "completed",
    train_loss: np.ndarray | None = None,
    convention: str | None = CONVENTION,
    **config: Any,
) -> Path:
    """A quadratics run with ``suboptimality`` at ``steps``, and ``train_loss`` [evals, workers] if
    given; ``convention`` is the loss it records (None: none, as runs of the 1/2 loss)."""
    suboptimality = np.asarray(suboptimality, dtype=float)
    steps = np.arange(len(suboptimality)) * 10 if steps is None else np.asarray(steps)
    config = make_config(task="quadratics", alpha=None, epochs=None, steps=int(steps[-1]), **config)
    workers = int(config["world_size"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with RunWriter.create(
        path, config=config, provenance={"factory": "tests"}, world_size=workers, overwrite=True
    ) as writer:
        rows = {
            "step": steps.astype(np.int64),
            "suboptimality": suboptimality,
            "consensus_distance": suboptimality / 2,
        }
        if train_loss is not None:
            rows["train_loss"] = np.asarray(train_loss, dtype=float)
        writer.extend(rows)
        if convention is not None:
            writer.set_attrs(**{QUADRATICS_CONVENTION_ATTR: convention})
        if status != "running":
            writer.set_status(status)
    return path


def write_empty_file(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def write_not_hdf5(path: Path) -> Path:
    path.write_text("this is not an HDF5 file\n")
    return path


def write_truncated_file(path: Path, source: Path) -> Path:
    """The first half of a valid run file, as left by a full disk or an interrupted copy."""
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def write_unknown_schema(path: Path, version: int = 99) -> Path:
    with h5py.File(path, "w") as file:
        file.attrs["schema_version"] = version
        file.attrs["status"] = "completed"
        file.attrs["config"] = "{}"
        file.attrs["provenance"] = "{}"
        file.attrs["world_size"] = 2
    return path


def write_foreign_hdf5(path: Path) -> Path:
    """A valid HDF5 file that is not a run file."""
    with h5py.File(path, "w") as file:
        file["x"] = np.arange(3)
    return path
