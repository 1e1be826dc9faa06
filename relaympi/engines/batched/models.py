"""All workers' models as one stacked parameter matrix X [N, d], run through torch.func.

Row i of X is worker i's flat parameter vector in the layout of ``flatten_module`` (the
module's parameters in ``parameters()`` order), so a row is bit for bit the ``x`` of the
same worker on the other backends. One forward/backward of all N models is a vmap over
rows of a functional call of one template module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from relaympi.config import ConfigError
from relaympi.tasks.base import ClassificationTask, Task

# Samples (workers x batch) per vmapped evaluation call: bounds the activations' memory.
EVAL_SAMPLES = 8192


def _overrides(task_class: type, method: str) -> bool:
    """Whether ``task_class`` overrides the task interface's own ``method``."""
    return len([cls for cls in task_class.__mro__ if method in vars(cls)]) > 1


def unsupported_reason(task_class: type, module: nn.Module | None = None) -> str | None:
    """Why a task's model cannot run as vmapped stacked copies, or None when it can (``module``
    None: what the class alone tells, before any data or model is loaded)."""
    if _overrides(task_class, "forward"):
        return (
            f"its model takes structured inputs ({task_class.__name__}.forward), which differ "
            "in shape between workers"
        )
    if module is None:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.track_running_stats:
            return (
                f"its module {name!r} ({type(sub).__name__}) updates running statistics in "
                "every forward pass"
            )
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"its module {name!r} draws dropout masks from torch's global random generator"
    if any(p.dtype != torch.float32 for p in module.parameters()):
        return "its parameters are not all float32"
    return None


def _plain_layers(module: nn.Module) -> list[nn.Module] | None:
    """The Linear and ReLU layers of an nn.Sequential(Flatten(), Linear/ReLU, ...) (the digits MLP),
    else None."""
    layers = list(module) if type(module) is nn.Sequential else []
    if (
        not layers
        or type(layers[0]) is not nn.Flatten
        or (layers[0].start_dim, layers[0].end_dim) != (1, -1)
    ):
        return None
    if not all(type(layer) in (nn.Linear, nn.ReLU) for layer in layers[1:]) or not all(
        p.requires_grad for p in module.parameters()
    ):
        return None
    return layers[1:]


def refuse_unsupported(task_class: type[Task], module: nn.Module | None = None) -> None:
    """ConfigError (exit 2) naming the backends that run the task, if this one cannot."""
    reason = unsupported_reason(task_class, module)
    if reason is not None:
        raise ConfigError(
            f"--backend batched cannot run task {task_class.name!r}: {reason}; run it "
            "with --backend local --workers N, or under mpirun"
        )


class BatchedModel:
    """N copies of ``task.build_model(seed)`` held as X [N, d]; gradients and evaluation for all at
    once.

    Buffers (constants such as a normalization layer's mean) are shared by every worker, which
    is exact because ``unsupported_reason`` refuses modules that change buffers in forward.
    """

    def __init__(
        self,
        task: ClassificationTask,
        seed: int,
        device: torch.device | str,
        autocast: torch.dtype | None = None,
    ):
        self.task = task
        self.device = torch.device(device)
        # dtype of the training forward and backward under torch.autocast (None: float32)
        self.autocast = autocast
        self.module = task.build_model(seed).to(self.device)
        refuse_unsupported(type(task), self.module)
        named = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.buffers = dict(self.module.named_buffers())
        with torch.no_grad():
            self.x0 = torch.cat([p.detach().reshape(-1) for _, p in named])
        # small MLPs run faster as explicit batched matrix products than through vmap's dispatch
        self._layers = _plain_layers(self.module)
        self._outputs = vmap(self._forward, in_dims=(0, 0))
        self._shared_outputs = vmap(self._forward, in_dims=(0, None))
        self._default_loss = not _overrides(type(task), "loss")

    @property
    def numel(self) -> int:
        return self.x0.numel()

    def stacked(self, world_size: int) -> torch.Tensor:
        """X(0) [N, d]: every worker starts from the same model, as on the other backends."""
        return self.x0.repeat(world_size, 1)

    def parameters(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """One worker's row as named parameter views (split, so backward is one concatenation)."""
        pieces = torch.split(x, self.sizes)
        return {
            name: piece.view(shape)
            for name, piece, shape in zip(self.names, pieces, self.shapes, strict=True)
        }

    def _forward(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, {**self.parameters(x), **self.buffers}, (inputs,))

    def outputs(self, X: torch.Tensor, inputs: torch.Tensor, shared: bool = False) -> torch.Tensor:
        """Every worker's logits [N, B, classes] for its own inputs [N, B, ...] (``shared``: one
        batch [B, ...] for all)."""
        if self._layers is None:
            return (self._shared_outputs if shared else self._outputs)(X, inputs)
        h = inputs.expand(X.shape[0], *inputs.shape) if shared else inputs
        n, params = X.shape[0], iter(torch.split(X, self.sizes, dim=1))
        h = h.flatten(2).transpose(1, 2)
        # activations as [N, features, B]: W h needs no transposed weight, so the weights' gradients
        # come out contiguous, in X's layout (no copy per layer in backward)
        for layer in self._layers:
            if isinstance(layer, nn.ReLU):
                h = torch.relu(h)
            elif isinstance(
                layer, nn.Linear
            ):  # parameters in named_parameters order: weight, then bias
                weight = next(params).view(n, *layer.weight.shape)
                h = (
                    torch.bmm(weight, h)
                    if layer.bias is None
                    else torch.baddbmm(next(params).view(n, -1, 1), weight, h)
                )
        return h.transpose(1, 2)

    def gradients(
        self, X: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(G [N, d], losses [N]): each worker's minibatch gradient and loss at its row of X.

        ``inputs`` [N, B, ...] and ``targets`` [N, B] hold each worker's own batch. Worker i's
        loss depends on row i alone, so the gradient of the sum of losses is every worker's own
        gradient: one vmapped forward and one ordinary backward (faster than vmap over grad).
        """
        self.module.train()
        X = X.detach().requires_grad_()
        with (
            torch.enable_grad(),
            torch.autocast(
                self.device.type,
                dtype=self.autocast or torch.bfloat16,
                enabled=self.autocast is not None,
            ),
        ):
            # autocast may leave bf16
            losses = self._losses(self.outputs(X, inputs), targets).to(X.dtype)
            (G,) = torch.autograd.grad(losses.sum(), X)
        return G, losses.detach()

    def _losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each worker's task loss [N] of outputs [N, B, classes] (cross-entropy outside vmap:
        faster)."""
        if not self._default_loss:
            return vmap(self.task.loss)(outputs, targets)
        n, b = outputs.shape[:2]
        flat = nn.functional.cross_entropy(
            outputs.reshape(n * b, -1), targets.reshape(n * b), reduction="none"
        )
        return flat.view(n, b).mean(dim=1)

    @torch.no_grad()
    def evaluate(self, X: torch.Tensor, batches: Any) -> dict[str, torch.Tensor]:
        """Every worker's own model on the full test set: per-worker test_loss and test_accuracy
        [N]."""
        self.module.eval()
        n = X.shape[0]
        loss_sum = torch.zeros(n, dtype=torch.float64, device=X.device)
        correct = torch.zeros(n, dtype=torch.int64, device=X.device)
        count = 0
        for inputs, targets in batches:
            inputs, targets = inputs.to(X.device), targets.to(X.device)
            group = max(1, EVAL_SAMPLES // max(int(targets.shape[0]), 1))
            for lo in range(0, n, group):
                outputs = self.outputs(X[lo : lo + group], inputs, shared=True)  # [g, b, classes]
                g, b = outputs.shape[:2]
                losses = nn.functional.cross_entropy(
                    outputs.reshape(g * b, -1), targets.repeat(g), reduction="none"
                ).view(g, b)
                loss_sum[lo : lo + g] += losses.sum(dim=1, dtype=torch.float64)
                correct[lo : lo + g] += (outputs.argmax(dim=2) == targets).sum(dim=1)
            count += int(targets.shape[0])
        count = max(count, 1)
        return {"test_loss": loss_sum / count, "test_accuracy": correct.double() / count}
