"""Rules that judge a finished run's numbers: workers left at chance, an unstable loss."""

from __future__ import annotations

import numpy as np

# A worker "ends at chance" when its accuracy is below this many times 1/num_classes (10% for
# ten classes): it learned nothing, often because the default lr does not suit the run.
CHANCE_FACTOR = 1.5
# ... judged only once the run's last evaluation follows this many epochs of training: before one
# pass over the training set a worker may still be near chance whatever its lr (at step 0 every
# model is untrained), so a run stopped or ended earlier is too short to judge
CHANCE_AFTER_EPOCHS = 1.0


def workers_at_chance(accuracy: np.ndarray, num_classes: int | None) -> list[int]:
    """The workers whose accuracy (one value per worker) is at chance level for num_classes."""
    if not num_classes or num_classes < 2:
        return []
    values = np.asarray(accuracy, dtype=float).reshape(-1)
    return [int(w) for w in np.flatnonzero(values < CHANCE_FACTOR / num_classes)]


# A run is "unstable" when its loss ends far above where it started (UNSTABLE_RULE). A run that
# learns ends well below its first recorded train loss (digits: about 2 after the first interval,
# 0.1-0.5 at the end), and the loss of one interval moves by tens of percent at most; one that ends
# above twice its start made every model worse than where training began: its optimization is
# unstable (D² under message loss: 2 -> 78), and its final numbers follow the float rounding of
# the engine that ran it, not the algorithm. 1x would also flag runs that merely learn nothing
# (the at-chance flag is for those); a looser factor would miss runs that blow up slowly.
UNSTABLE_FACTOR = 2.0
UNSTABLE_RULE = f"final mean train loss > {UNSTABLE_FACTOR:g}x the first recorded"


def present_mean(values: np.ndarray, present: np.ndarray | None = None) -> np.ndarray:
    """Per row of [rows, workers] ``values``, the mean over the workers ``present`` there
    ([rows, workers] bool, ``Run.present()``; None: all). A lost worker's NaN (not present) is
    left out; a NaN of a present worker makes its row's mean NaN, as a non-finite value should."""
    values = np.asarray(values, dtype=float)
    values = values.reshape(len(values), -1)
    if present is None:
        return values.mean(axis=1)
    mask = np.asarray(present, dtype=bool).reshape(values.shape)
    count = mask.sum(axis=1)
    total = np.where(mask, values, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def nonfinite_workers(values: np.ndarray, present: np.ndarray | None = None) -> list[int]:
    """The workers with a non-finite value in [rows, workers] ``values`` at a row where they were
    ``present`` (a lost worker's NaN after its membership change does not count)."""
    values = np.asarray(values, dtype=float)
    values = values.reshape(len(values), -1)
    bad = ~np.isfinite(values)
    if present is not None:
        bad &= np.asarray(present, dtype=bool).reshape(values.shape)
    return [int(w) for w in np.flatnonzero(bad.any(axis=0))]


def unstable_loss(
    train_loss: np.ndarray, present: np.ndarray | None = None
) -> tuple[float, float] | None:
    """(first, final) mean train loss over workers when the run is unstable (UNSTABLE_RULE), else
    None.

    ``train_loss`` is a run file's [evals, workers] dataset; ``present`` ([evals, workers] bool,
    ``Run.present()``) says which workers took part in each row: a worker lost by a membership
    change leaves the means from its change on (its NaN there is by design). The first recorded
    value is the first evaluation whose mean is finite (a classification run records NaN at step
    0, before any step); the final one is the last evaluation's. A non-finite final loss (of a
    worker present) is not judged: such a run has status diverged.
    """
    values = np.asarray(train_loss, dtype=float)
    if values.ndim == 0 or len(values) < 2:
        return None
    means = present_mean(values, present)
    finite = np.flatnonzero(np.isfinite(means))
    if len(finite) < 2 or finite[-1] != len(means) - 1:
        return None
    first, final = float(means[finite[0]]), float(means[-1])
    return (first, final) if first > 0 and final > UNSTABLE_FACTOR * first else None


def unstable_text(loss: tuple[float, float]) -> str:
    """How the end summary, `python -m relaympi.results show` and the report flag an unstable
    run."""
    first, final = loss
    return (
        f"unstable: final mean train loss {final:.4g} > {UNSTABLE_FACTOR:g}x the first "
        f"recorded {first:.4g} "
        "(its numbers depend on the engine's float rounding; try a lower --lr)"
    )
