"""Random quadratics (paper appendix "Random quadratics"): f_i(x) = 1/2 ||A_i x - b_i||^2 with
controlled L, mu, zeta^2, r0."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import h5py
import numpy as np

from relaympi.tasks.base import Task, TaskDefaults


@dataclass(frozen=True)
class QuadraticsSpec:
    dim: int = 50
    mu: float = 0.5  # smallest singular value of every A_i
    L: float = 1.0  # largest singular value of every A_i
    zeta2: float = 1.0  # heterogeneity 1/n sum_i ||grad f_i(x*)||^2
    r0: float = 10.0  # ||x(0) - x*|| with x(0) = 0
    sigma2: float = 0.0  # gradient noise variance E||xi||^2

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if not 0 < self.mu <= self.L:  # also refuses NaN
            raise ValueError(f"need 0 < mu <= L, got mu={self.mu}, L={self.L}")
        for name in ("zeta2", "r0", "sigma2"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                finite = " and finite" if math.isinf(value) else ""
                raise ValueError(f"{name} must be >= 0{finite}, got {value}")


@dataclass
class Quadratics:
    """n local objectives; the global objective is their mean. Arrays are float64."""

    A: np.ndarray  # [n, d, d]
    b: np.ndarray  # [n, d]
    x_star: np.ndarray  # [d]
    f_star: float
    sigma2: float = 0.0

    def __post_init__(self) -> None:
        if (
            self.A.ndim != 3
            or self.A.shape[1] != self.A.shape[2]
            or self.b.shape != self.A.shape[:2]
        ):
            raise ValueError(
                f"expected A [n,d,d] and b [n,d], got A {self.A.shape} and b {self.b.shape}"
            )
        self.AtA = np.einsum("nki,nkj->nij", self.A, self.A)
        self.Atb = np.einsum("nki,nk->ni", self.A, self.b)

    @property
    def num_workers(self) -> int:
        return self.A.shape[0]

    @property
    def dim(self) -> int:
        return self.A.shape[1]

    def local_gradient(self, i: int, x: np.ndarray) -> np.ndarray:
        return self.AtA[i] @ x - self.Atb[i]

    def gradients(self, X: np.ndarray) -> np.ndarray:
        """Row i: grad f_i(X[i]) = A_i^T (A_i X[i] - b_i)."""
        return np.einsum("nij,nj->ni", self.AtA, X) - self.Atb

    def noise(self, seed: int, step: int, rank: int) -> np.ndarray:
        """Gradient noise with E||xi||^2 = sigma2, a pure function of (seed, step, rank)."""
        if self.sigma2 == 0:
            return np.zeros(self.dim)
        rng = np.random.default_rng([seed, step, rank, 7])
        return rng.standard_normal(self.dim) * np.sqrt(self.sigma2 / self.dim)

    def loss(self, x: np.ndarray) -> float:
        """f(x) = 1/n sum_i 1/2 ||A_i x - b_i||^2."""
        r = np.einsum("nij,j->ni", self.A, x) - self.b
        return float(0.5 * np.mean(np.sum(r * r, axis=1)))

    def local_losses(self, X: np.ndarray) -> np.ndarray:
        r = np.einsum("nij,nj->ni", self.A, X) - self.b
        return 0.5 * np.sum(r * r, axis=1)

    def suboptimality(self, X: np.ndarray) -> float:
        """f(x_bar) - f* of the workers' average model."""
        return self.loss(X.mean(axis=0)) - self.f_star

    def summary(self, X: np.ndarray) -> dict[str, float]:
        """The run file's quadratics metrics of all workers' iterates X [n, d]."""
        mean = X.mean(axis=0)
        return {
            "suboptimality": self.suboptimality(X),
            "consensus_distance": float(np.mean(np.sum((X - mean) ** 2, axis=1))),
        }

    def heterogeneity(self) -> float:
        g = self.gradients(np.repeat(self.x_star[None], self.num_workers, axis=0))
        return float(np.mean(np.sum(g * g, axis=1)))

    def digest(self) -> str:
        """The problem's sha256 (hex): of the shape of A and of A, b and sigma2 as little-endian
        float64. The same problem gives the same digest however it was made (generated, or read
        from a problem file); a run file records it, and the report tells problems apart by it."""
        sha = hashlib.sha256(b"relaympi quadratics: A, b, sigma2\n")
        sha.update(np.asarray(self.A.shape, dtype="<i8").tobytes())
        for array in (self.A, self.b, np.float64(self.sigma2)):
            sha.update(np.ascontiguousarray(array, dtype="<f8").tobytes())
        return sha.hexdigest()

    def save(self, path: str | Path) -> None:
        with h5py.File(path, "w") as f:
            f.create_dataset("A", data=self.A)
            f.create_dataset("b", data=self.b)
            f.create_dataset("x_star", data=self.x_star)
            f.attrs["f_star"] = self.f_star
            f.attrs["sigma2"] = self.sigma2
            f.attrs["objective"] = "f_i(x) = 1/2 ||A_i x - b_i||^2, f = mean_i f_i"


def _minimize(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    AtA = np.einsum("nki,nkj->ij", A, A)
    Atb = np.einsum("nki,nk->i", A, b)
    return np.linalg.solve(AtA, Atb)


def from_arrays(
    A: np.ndarray,
    b: np.ndarray,
    x_star: np.ndarray | None = None,
    f_star: float | None = None,
    sigma2: float = 0.0,
) -> Quadratics:
    """A problem from its arrays; x* and f* are computed when absent."""
    A, b = np.asarray(A, dtype=np.float64), np.asarray(b, dtype=np.float64)
    x = _minimize(A, b) if x_star is None else np.asarray(x_star, dtype=np.float64)
    q = Quadratics(A, b, x, 0.0, sigma2)
    q.f_star = q.loss(x) if f_star is None else float(f_star)
    return q


def load(path: str | Path, world_size: int | None = None) -> Quadratics:
    """Read a problem file (datasets A [n,d,d], b [n,d]; optional x_star [d], attribute f_star)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"problem file {path} does not exist")
    try:
        with h5py.File(path, "r") as f:
            if "A" not in f or "b" not in f:
                raise ValueError(
                    f"problem file {path} must hold datasets 'A' [n,d,d] and 'b' [n,d]; "
                    f"found {sorted(f)}"
                )
            A, b = f["A"][()], f["b"][()]
            x_star = f["x_star"][()] if "x_star" in f else None
            f_star = float(f.attrs["f_star"]) if "f_star" in f.attrs else None
            sigma2 = float(f.attrs.get("sigma2", 0.0))
    except OSError as exc:
        raise ValueError(f"problem file {path} is not a readable HDF5 file: {exc}") from exc
    if world_size is not None and A.shape[0] != world_size:
        raise ValueError(
            f"problem file {path} has {A.shape[0]} local objectives but the run has "
            f"{world_size} workers"
        )
    return from_arrays(A, b, x_star, f_star, sigma2)


def generate(n: int, spec: QuadraticsSpec, seed: int = 0) -> Quadratics:
    """A random instance following the paper's appendix procedure (with the 1/2 ||A x - b||^2
    loss)."""
    rng = np.random.default_rng([seed, 0xC0FFEE])
    d = spec.dim
    singular = np.linspace(spec.mu, spec.L, d)
    A = np.empty((n, d, d))
    for i in range(n):
        U, _, Vt = np.linalg.svd(rng.standard_normal((d, d)))
        A[i] = (U * singular) @ Vt
    directions = rng.standard_normal((n, d))

    def offsets(scale: float) -> np.ndarray:
        b = np.einsum("nij,nj->ni", A, scale * directions)  # local optima at scale * d_i
        shift = _minimize(A, b)
        return b - np.einsum("nij,j->ni", A, shift)  # global optimum back at 0

    def zeta2(b: np.ndarray) -> float:
        g = np.einsum("nki,nk->ni", A, b)  # grad f_i(0) = -A_i^T b_i
        return float(np.mean(np.sum(g * g, axis=1)))

    # zeta^2 grows as scale^2 (offsets are linear in the scale), so the search converges in one
    # step; the loop guards the general case.
    scale = 1.0
    if spec.zeta2 > 0 and n > 1:
        for _ in range(50):
            current = zeta2(offsets(scale))
            if current == 0 or abs(current - spec.zeta2) <= 1e-12 * spec.zeta2:
                break
            scale *= np.sqrt(spec.zeta2 / current)
        b = offsets(scale)
    else:
        b = np.zeros((n, d))
    x_star = rng.standard_normal(d)
    x_star *= spec.r0 / max(float(np.linalg.norm(x_star)), 1e-300)
    b = b + np.einsum("nij,j->ni", A, x_star)
    return from_arrays(A, b, None, None, spec.sigma2)


class QuadraticsTask(Task):
    """The random quadratics as a training task: worker i minimizes f_i from x(0) = 0 in float64.

    One "epoch" is one step (every worker's full local objective); the run is evaluated
    ``evals_per_run`` times. The problem is generated from the config (or read from
    --problem-file) once, when the run is resolved, and shared by every worker.
    """

    name = "quadratics"
    defaults = TaskDefaults(
        epochs=1,
        batch_size=1,
        lr=0.1,
        momentum=0.0,
        eval_every_epochs=1,
        lr_tuned_workers=None,
        evals_per_run=200,
    )

    option_names: ClassVar[tuple[str, ...]] = (
        "problem_file",
        "seed",
        *(f.name for f in fields(QuadraticsSpec)),
    )

    @classmethod
    def settle(cls, options: dict[str, Any], world_size: int) -> tuple[dict[str, Any], Quadratics]:
        """The problem to train on, and the options recording what it is (the file's dim, not a
        default).

        Raises ValueError (bad spec or file) for the caller to report as a usage error.
        """
        spec_keys = [f.name for f in fields(QuadraticsSpec)]
        problem_file = options["problem_file"]
        if problem_file is None:
            given = {k: options[k] for k in spec_keys if options[k] is not None}
            spec = replace(QuadraticsSpec(), **given)
            return {**options, **{k: getattr(spec, k) for k in spec_keys}}, generate(
                world_size, spec, options["seed"]
            )
        problem = load(problem_file, world_size)
        for name, value in (("dim", problem.dim), ("sigma2", problem.sigma2)):
            given = options[name]
            if given is not None and given != value:
                raise ValueError(
                    f"--{name} {given} conflicts with --problem-file {problem_file}, "
                    f"which has {name} {value:g}; drop --{name}"
                )
        return {**options, "dim": problem.dim, "sigma2": problem.sigma2}, problem

    @classmethod
    def model_bytes(cls, settled: dict[str, Any], problem: Quadratics) -> int:
        return 8 * problem.dim  # x in float64

    @staticmethod
    def holds(path: str | Path, problem: Quadratics) -> bool:
        """Whether the problem file at ``path`` holds exactly ``problem``."""
        try:
            saved = load(path)
        except Exception:  # noqa: BLE001 - anything unreadable is "another file", never replaced silently
            return False
        return (
            saved.A.shape == problem.A.shape
            and np.array_equal(saved.A, problem.A)
            and np.array_equal(saved.b, problem.b)
            and saved.sigma2 == problem.sigma2
        )
