"""What a checkpoint holds of a training loop (relaympi.training.loop): its workers' model,
optimizer and algorithm state on the CPU, the byte counts, the running train loss and the timers,
with the engine's own part; and how a loop gets them back."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.training.evaluation import Timers

# ``loop`` below is a relaympi.training.loop.TrainingLoop, which imports this module
TrainingLoop = Any


def checkpoint_state(loop: TrainingLoop) -> dict[str, Any]:
    """This process's checkpoint state.

    Args:
        loop: the training loop whose workers are saved.

    Returns:
        Tensors on the CPU, by name (the engine's membership part included).
    """
    return {
        "x": loop.x.detach().cpu(),
        "optimizer": to_cpu(loop.optimizer.state_dict()),
        "algorithm": to_cpu(loop.algorithm.state_dict()),
        "bytes_sent": torch.from_numpy(np.array(loop.bytes_counter, dtype=np.int64)),
        **common_state(loop),
        **loop.membership_state(),
    }


def restore_state(loop: TrainingLoop, state: dict[str, Any]) -> None:
    """Back to ``state`` (``checkpoint_state``'s): the engine's membership part first, then the
    model, optimizer, algorithm, bytes and the loop's own part, then the engine's finish.

    Args:
        loop: the training loop to restore.
        state: a checkpoint's state.
    """
    loop.restore_membership(state)
    device = loop.x.device
    loop.x.copy_(state["x"])
    loop.optimizer.load_state_dict(to_device(state["optimizer"], device))
    loop.algorithm.load_state_dict(to_device(state["algorithm"], device))
    loop.bytes_counter[...] = state["bytes_sent"].numpy()
    restore_common(loop, state)
    loop.restored(state)


def common_state(loop: TrainingLoop) -> dict[str, Any]:
    """The loop's own part of a checkpoint: the running loss and the timers.

    Args:
        loop: the training loop.

    Returns:
        Tensors by name.
    """
    return {
        "loss_sum": torch.as_tensor(loop.loss_sum, dtype=torch.float64).clone(),
        "loss_count": torch.tensor(loop.loss_count),
        "timers": torch.tensor([*loop.timers.to_list(), loop.elapsed()], dtype=torch.float64),
        **(
            {"eval_train_loss": torch.as_tensor(loop.last_train_loss, dtype=torch.float64).clone()}
            if loop.loss_count == 0 and loop.last_train_loss is not None
            else {}
        ),
    }


def restore_common(loop: TrainingLoop, state: dict[str, Any]) -> None:
    """Back to ``common_state``'s part of ``state``.

    Args:
        loop: the training loop.
        state: a checkpoint's state.
    """
    loss_sum = state["loss_sum"].numpy()
    loop.loss_sum = float(loss_sum) if loss_sum.ndim == 0 else loss_sum.copy()
    loop.loss_count = int(state["loss_count"])
    *timers, loop.wall_offset = (float(v) for v in state["timers"])
    loop.timers = Timers.from_list(timers)
    if "eval_train_loss" in state:
        loss = state["eval_train_loss"].numpy()
        loop.last_train_loss = float(loss) if loss.ndim == 0 else loss.copy()


def to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its tensors detached on the CPU.

    Args:
        state: a state dict (one level).

    Returns:
        A new dict.
    """
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def to_device(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` with its tensors on ``device``.

    Args:
        state: a state dict (one level).
        device: where the tensors go.

    Returns:
        A new dict.
    """
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
