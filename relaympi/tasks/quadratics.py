"""Random quadratics (paper appendix "Random quadratics") in the paper's own terms.

Worker i's loss is f_i(x) = ||A_i x - b_i||^2, without a 1/2; the global objective is their mean
f = (1/n) sum_i f_i, its gradient is grad f_i(x) = 2 A_i^T (A_i x - b_i), the heterogeneity is
zeta^2 = (1/n) sum_i ||grad f_i(x*)||^2 with that gradient, and a run's suboptimality is
f(x_bar) - f(x*) in that loss (CONVENTION names it in run files and problem files).

The sign: the appendix writes ||A_i x + b_i||^2 but its generation steps (moving the global
optimum to zero with b_i <- b_i - A_i x*, then to x* with b_i <- b_i + A_i x*) place the optimum
where they say only with ||A_i x - b_i||^2, the form the authors' code uses. relaympi stores that
b_i: the appendix's offset is its negative, the problem is the same.

``generate`` follows the appendix step by step (one function per step below); ``mu`` and ``L`` are
the smallest and largest singular value of every A_i as its step 2 sets them, so f_i's Hessian
2 A_i^T A_i has eigenvalues in [2 mu^2, 2 L^2].
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import h5py
import numpy as np

from relaympi.tasks.base import Task
from relaympi.tasks.defaults import QUADRATICS

# What run files (root attribute relaympi.results.schema.QUADRATICS_CONVENTION_ATTR) and problem
# files (attribute "objective") record: the loss, gradient and heterogeneity every number is in.
CONVENTION = (
    "f_i(x) = ||A_i x - b_i||^2, grad f_i(x) = 2 A_i^T (A_i x - b_i), "
    "zeta2 = mean_i ||grad f_i(x*)||^2"
)
# The "objective" of problem files written before CONVENTION (the loss had a 1/2): their A and b
# are the same problem, their f_star is half of the loss's.
HALF_CONVENTION = "f_i(x) = 1/2 ||A_i x - b_i||^2, f = mean_i f_i"


@dataclass(frozen=True)
class QuadraticsSpec:
    """The constants of a generated problem (the appendix's d, mu, L, zeta^2, r0; and sigma^2)."""

    dim: int = 50
    mu: float = 0.5  # smallest singular value of every A_i
    L: float = 1.0  # largest singular value of every A_i
    zeta2: float = 1.0  # heterogeneity 1/n sum_i ||grad f_i(x*)||^2 (module docstring)
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
    """n local objectives f_i(x) = ||A_i x - b_i||^2; the global objective is their mean.

    Arrays are float64. ``H`` [n, d, d] and ``c`` [n, d] hold every worker's gradient in one
    place: grad f_i(x) = H[i] @ x - c[i], with H_i = 2 A_i^T A_i and c_i = 2 A_i^T b_i.
    """

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
        self.H = 2.0 * np.einsum("nki,nkj->nij", self.A, self.A)
        self.c = 2.0 * np.einsum("nki,nk->ni", self.A, self.b)

    @property
    def num_workers(self) -> int:
        return self.A.shape[0]

    @property
    def dim(self) -> int:
        return self.A.shape[1]

    def local_gradient(self, i: int, x: np.ndarray) -> np.ndarray:
        """grad f_i(x) = 2 A_i^T (A_i x - b_i).

        Args:
            i: the worker.
            x: its iterate [d].

        Returns:
            The gradient [d].
        """
        return self.H[i] @ x - self.c[i]

    def gradients(self, X: np.ndarray) -> np.ndarray:
        """Row i: grad f_i(X[i]) = 2 A_i^T (A_i X[i] - b_i).

        Args:
            X: every worker's iterate [n, d].

        Returns:
            Every worker's gradient [n, d].
        """
        return np.einsum("nij,nj->ni", self.H, X) - self.c

    def noise(self, seed: int, step: int, rank: int) -> np.ndarray:
        """Gradient noise with E||xi||^2 = sigma2, a pure function of (seed, step, rank)."""
        if self.sigma2 == 0:
            return np.zeros(self.dim)
        rng = np.random.default_rng([seed, step, rank, 7])
        return rng.standard_normal(self.dim) * np.sqrt(self.sigma2 / self.dim)

    def loss(self, x: np.ndarray) -> float:
        """f(x) = 1/n sum_i ||A_i x - b_i||^2.

        Args:
            x: one model [d].

        Returns:
            The global objective at x.
        """
        r = np.einsum("nij,j->ni", self.A, x) - self.b
        return float(np.mean(np.sum(r * r, axis=1)))

    def local_losses(self, X: np.ndarray) -> np.ndarray:
        """Row i: f_i(X[i]) = ||A_i X[i] - b_i||^2.

        Args:
            X: every worker's iterate [n, d].

        Returns:
            Every worker's own loss [n].
        """
        r = np.einsum("nij,nj->ni", self.A, X) - self.b
        return np.sum(r * r, axis=1)

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
        """zeta^2 = 1/n sum_i ||grad f_i(x*)||^2 with the gradient 2 A_i^T (A_i x - b_i)."""
        return heterogeneity_at(self.A, self.b, self.x_star)

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
            f.attrs["objective"] = CONVENTION


def heterogeneity_at(A: np.ndarray, b: np.ndarray, x: np.ndarray) -> float:
    """1/n sum_i ||2 A_i^T (A_i x - b_i)||^2: zeta^2 when x is the global optimum.

    Args:
        A: the matrices [n, d, d].
        b: the offsets [n, d].
        x: the point [d].

    Returns:
        The mean squared norm of the local gradients at x.
    """
    residual = np.einsum("nij,j->ni", A, x) - b
    g = 2.0 * np.einsum("nki,nk->ni", A, residual)
    return float(np.mean(np.sum(g * g, axis=1)))


def global_optimum(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The minimizer of 1/n sum_i ||A_i x - b_i||^2: (sum A_i^T A_i)^-1 sum A_i^T b_i.

    Args:
        A: the matrices [n, d, d].
        b: the offsets [n, d].

    Returns:
        x* [d].
    """
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
    x = global_optimum(A, b) if x_star is None else np.asarray(x_star, dtype=np.float64)
    q = Quadratics(A, b, x, 0.0, sigma2)
    q.f_star = q.loss(x) if f_star is None else float(f_star)
    return q


def load(path: str | Path, world_size: int | None = None) -> Quadratics:
    """Read a problem file (datasets A [n,d,d], b [n,d]; optional x_star [d], attributes f_star,
    sigma2 and objective).

    The file's ``objective`` names its loss: CONVENTION (or none: a file made by hand) is read as
    it is; HALF_CONVENTION (files written before the loss lost its 1/2) holds the same problem,
    so only its f_star is doubled; any other objective is refused.
    """
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
            objective = f.attrs.get("objective", CONVENTION)
    except OSError as exc:
        raise ValueError(f"problem file {path} is not a readable HDF5 file: {exc}") from exc
    if isinstance(objective, bytes):
        objective = objective.decode("utf-8", errors="replace")
    if objective == HALF_CONVENTION:
        f_star = None if f_star is None else 2.0 * f_star
    elif objective != CONVENTION:
        raise ValueError(
            f"problem file {path} has objective {str(objective)[:80]!r}; relaympi reads "
            f"{CONVENTION!r} (or the older {HALF_CONVENTION!r})"
        )
    if world_size is not None and A.shape[0] != world_size:
        raise ValueError(
            f"problem file {path} has {A.shape[0]} local objectives but the run has "
            f"{world_size} workers"
        )
    return from_arrays(A, b, x_star, f_star, sigma2)


def shaped_matrices(rng: np.random.Generator, n: int, spec: QuadraticsSpec) -> np.ndarray:
    """Appendix steps 1 and 2: A_i i.i.d. standard normal, then U_i S~ V_i^T from its SVD, S~ with
    the singular values mu, (d-2)/(d-1) mu + 1/(d-1) L, ..., L (linearly spaced).

    Args:
        rng: the problem's random stream (drawn from first).
        n: workers.
        spec: the constants (dim, mu, L).

    Returns:
        A [n, d, d].
    """
    d = spec.dim
    singular = np.linspace(spec.mu, spec.L, d)
    A = np.empty((n, d, d))
    for i in range(n):
        U, _, Vt = np.linalg.svd(rng.standard_normal((d, d)))
        A[i] = (U * singular) @ Vt
    return A


def centered_offsets(A: np.ndarray, directions: np.ndarray, scale: float) -> np.ndarray:
    """Appendix steps 3c and 3d: b_i = A_i s d_i (worker i's own optimum at s d_i), then
    b_i <- b_i - A_i x* so that the global optimum x* moves to zero.

    Args:
        A: the matrices [n, d, d].
        directions: the random directions d_i [n, d].
        scale: s.

    Returns:
        b [n, d] whose global optimum is 0.
    """
    b = np.einsum("nij,nj->ni", A, scale * directions)
    return b - np.einsum("nij,j->ni", A, global_optimum(A, b))


def heterogeneity_scale(A: np.ndarray, directions: np.ndarray, zeta2: float) -> float:
    """Appendix step 3e: the scale s at which the centered offsets have heterogeneity ``zeta2``.

    The appendix searches s by bisection; the offsets, the optimum they move and so the local
    gradients at it are linear in s, so zeta^2(s) = s^2 zeta^2(1) exactly, and the bisection's
    limit is s = sqrt(zeta2 / zeta^2(1)), taken here directly (zeta^2 then holds to rounding,
    where the authors' code stops its search within 1e-5).

    Args:
        A: the matrices [n, d, d].
        directions: the random directions d_i [n, d].
        zeta2: the heterogeneity to reach (> 0).

    Returns:
        s; 0 where no scale makes heterogeneity (one worker).
    """
    unit = heterogeneity_at(A, centered_offsets(A, directions, 1.0), np.zeros(A.shape[1]))
    return math.sqrt(zeta2 / unit) if unit > 0 else 0.0


def generate(n: int, spec: QuadraticsSpec, seed: int = 0) -> Quadratics:
    """A random instance made by the appendix's procedure, step by step (module docstring).

    Args:
        n: workers (local objectives).
        spec: the constants.
        seed: picks the instance.

    Returns:
        The problem, its global optimum x* at norm r0 and its heterogeneity spec.zeta2.
    """
    rng = np.random.default_rng([seed, 0xC0FFEE])
    A = shaped_matrices(rng, n, spec)  # steps 1 and 2
    directions = rng.standard_normal((n, spec.dim))  # step 3a
    scale = heterogeneity_scale(A, directions, spec.zeta2) if spec.zeta2 > 0 else 0.0  # 3b, 3e
    b = centered_offsets(A, directions, scale)  # steps 3c, 3d: the optimum at 0
    x_star = rng.standard_normal(spec.dim)  # step 4: x* at norm r0, every optimum moved by it
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
    defaults = QUADRATICS

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
