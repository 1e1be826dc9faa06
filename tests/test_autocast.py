"""--autocast bf16: the batched engine's forward and backward in bfloat16, recorded, and refused
elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaympi import train
from relaympi.config import ConfigError, parse_args
from relaympi.engines.batched.models import BatchedModel
from relaympi.results import read_run
from relaympi.tasks import ClassificationTask, TaskOptions, get_task_class


@pytest.mark.slow
def test_bf16_gradients_are_within_bfloat16_rounding_of_float32():
    cls = get_task_class("digits")
    assert issubclass(cls, ClassificationTask)
    task = cls(TaskOptions())
    fp32, bf16 = BatchedModel(task, 0, "cpu"), BatchedModel(task, 0, "cpu", autocast=torch.bfloat16)
    X = fp32.stacked(4) + 0.01 * torch.randn(
        4, fp32.numel, generator=torch.Generator().manual_seed(0)
    )
    inputs, targets = task.train_batch(torch.arange(32).numpy(), np.random.default_rng(0))
    inputs, targets = inputs.view(4, 8, *inputs.shape[1:]), targets.view(4, 8)
    G32, L32 = fp32.gradients(X, inputs, targets)
    G16, L16 = bf16.gradients(X, inputs, targets)
    assert G16.dtype == L16.dtype == torch.float32
    scale = G32.abs().max()
    error = float((G16 - G32).abs().max() / scale)
    # bfloat16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3): a few roundings through two layers,
    # not more
    assert 1e-5 < error < 5e-2, error
    assert float((L16 - L32).abs().max() / L32.abs().max()) < 2e-2


def test_a_bf16_run_records_it_and_learns_as_float32_does(tmp_path):
    args = [
        "--task",
        "digits",
        "--algo",
        "relay",
        "--alpha",
        "1",
        "--steps",
        "60",
        "--eval-every",
        "60",
        "--lr",
        "0.4",
        "--backend",
        "batched",
        "--workers",
        "4",
    ]
    assert train.main([*args, "--out", str(tmp_path / "fp32.h5")]) == 0
    assert train.main([*args, "--autocast", "bf16", "--out", str(tmp_path / "bf16.h5")]) == 0
    fp32, bf16 = read_run(tmp_path / "fp32.h5"), read_run(tmp_path / "bf16.h5")
    assert bf16.config["autocast"] == "bf16" and fp32.config["autocast"] is None
    accuracy32, accuracy16 = (
        float(fp32.data["test_accuracy"][-1].mean()),
        float(bf16.data["test_accuracy"][-1].mean()),
    )
    assert accuracy32 > 0.5, accuracy32  # 10 classes: chance is 0.1
    assert abs(accuracy16 - accuracy32) < 0.05, (accuracy16, accuracy32)
    # bf16 was in effect
    assert (
        accuracy16 != accuracy32 or not (bf16.data["train_loss"] == fp32.data["train_loss"]).all()
    )


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--backend", "local", "--workers", "2"], "--autocast"),
        (
            ["--backend", "batched", "--workers", "2", "--task", "quadratics", "--steps", "2"],
            "--autocast",
        ),
    ],
)
def test_autocast_is_refused_where_it_cannot_apply(extra, match):
    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--autocast", "bf16", *extra])


def test_an_unknown_autocast_dtype_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--autocast", "fp8", "--backend", "batched", "--workers", "2"])
    assert exc.value.code == 2 and "fp8" in capsys.readouterr().err
