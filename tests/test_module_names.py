"""One job per module, and names that say what they are: each renamed or moved name is found at
its new home, does what it did, and the old name is gone."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from relaympi import comm
from relaympi.comm import buffers


def test_the_flat_layout_is_its_own_module_not_comm() -> None:
    from relaympi import flat

    model = torch.nn.Linear(3, 2)
    x, g = flat.flatten_module(model)
    assert x.numel() == 8 and flat.spare_slots(x) is not None  # RelaySum's spare slots around it
    assert model.weight.data.data_ptr() == x.data_ptr()
    fb = flat.FlatBuffer.zeros([(2, 2), (1,)], like=np.zeros(1))
    assert fb.flat.shape == (5,) and fb.views[0].shape == (2, 2)
    for name in (
        "FlatBuffer",
        "flatten_module",
        "padded_zeros",
        "padded_zeros_like",
        "spare_slots",
    ):
        assert not hasattr(buffers, name), f"comm.buffers still holds {name}"
        assert not hasattr(comm, name), f"relaympi.comm still exports {name}"
    assert (
        comm.BufferError is buffers.BufferError
        and comm.query_cuda_aware_mpi is buffers.query_cuda_aware_mpi
    )


def test_one_ranks_message_passing_run_is_a_message_passing_rank() -> None:
    from relaympi.engines import message_passing
    from relaympi.training.loop import TrainingLoop

    assert issubclass(message_passing.MessagePassingRank, TrainingLoop)
    assert not hasattr(message_passing, "Worker")


def test_the_checkpoint_file_format_is_checkpoint_files() -> None:
    from relaympi.training import checkpoint_files

    assert all(
        callable(getattr(checkpoint_files, f))
        for f in ("save", "load", "prune", "read_meta", "write_meta", "forget")
    )
    assert not (Path(checkpoint_files.__file__).parent / "checkpoint.py").exists()
    # it moved into training, its only user: the top-level module is gone
    assert not (Path(checkpoint_files.__file__).parent.parent / "checkpoint_files.py").exists()


def test_a_matrix_form_names_the_matrix_algorithm_it_steps() -> None:
    from relaympi.algorithms.matrix import make_matrix_algorithm
    from relaympi.optim import OptimizerConfig
    from relaympi.topology import build

    algo = make_matrix_algorithm(
        "dpsgd", build("ring", 4), 4, np.zeros(3), OptimizerConfig(name="sgd")
    )
    assert algo.form.matrix_algorithm is algo and not hasattr(algo.form, "engine")


def test_the_two_world_size_checks_have_two_names() -> None:
    from relaympi import algorithms, topology
    from relaympi.algorithms import AlgorithmError
    from relaympi.topology import TopologyError
    from relaympi.topology.core import as_world_size

    # a count, as an int
    assert as_world_size(np.int64(5)) == 5 and type(as_world_size(np.int64(5))) is int
    with pytest.raises(TopologyError, match="ring world_size must be >= 2, got 1"):
        as_world_size(1, what="ring world_size", minimum=2)
    # a topology against the world
    algorithms.check_topology_fits_world(topology.build("ring", 4), 4)
    with pytest.raises(AlgorithmError, match="topology 'ring' is for 4 workers, the world has 3"):
        algorithms.check_topology_fits_world(topology.build("ring", 4), 3)
    for module in (
        "relaympi.topology.core",
        "relaympi.topology.graphs",
        "relaympi.algorithms.registry",
        "relaympi.tasks.partition",
    ):
        names = vars(importlib.import_module(module))
        assert "check_world_size" not in names and "_check_world_size" not in names
    assert "check_world_size" not in algorithms.__all__


def test_the_docs_layout_names_real_modules_and_where_new_pieces_go() -> None:
    """docs/design.md's Layout names files that exist; docs/contributing.md says where each kind of
    new piece goes."""
    import re

    root = Path(__file__).resolve().parent.parent
    design = (root / "docs" / "design.md").read_text(encoding="utf-8")
    layout = design.split("## Layout", 1)[1].split("\n## ", 1)[0]
    for path in re.findall(
        r"(?:relaympi|benchmarks|jobs|cluster|scripts)/[\w/.]+\.(?:py|sh)", layout
    ):
        # a module, or the package it became
        assert (root / path).is_file() or (root / path).with_suffix("").is_dir(), (
            f"docs/design.md's Layout names {path}, which does not exist"
        )
    for name in ("flat.py", "checkpoint_files.py", "MessagePassingRank"):
        assert name in layout
    contributing = (root / "docs" / "contributing.md").read_text(encoding="utf-8")
    where = contributing.split("## Where a new piece goes", 1)[1].split("\n## ", 1)[0]
    for piece, home in (
        ("algorithm", "relaympi/algorithms/registry.py"),
        ("task", "relaympi/tasks/__init__.py"),
        ("engine", "relaympi/engines/__init__.py"),
        ("flag", "relaympi/config/"),
    ):
        line = re.search(rf"^- a new {piece}:(.*?)(?=^- |\Z)", where, re.S | re.M)
        assert line and home in line.group(1), (
            f"docs/contributing.md says nowhere where a new {piece} goes"
        )


LONG_MODULE_LINES = 500
# the line near the top of a long file that says why it is long, by the file's kind
LONG_REASON = {"*.py": "# Long module: ", "*.sh": "# Long script: "}


def long_files_without_a_reason(root: Path) -> list[str]:
    """The Python modules and shell scripts over LONG_MODULE_LINES lines whose first 20 lines hold
    no reason line (LONG_REASON), as 'path (n lines, needs "# Long ...: ")'."""
    unexplained = []
    for tree in ("relaympi", "benchmarks", "jobs", "scripts", "tests", "cluster"):
        for pattern, reason in LONG_REASON.items():
            for path in sorted((root / tree).rglob(pattern)):
                lines = path.read_text(encoding="utf-8").splitlines()
                if len(lines) > LONG_MODULE_LINES and not any(
                    line.startswith(reason) for line in lines[:20]
                ):
                    unexplained.append(
                        f"{path.relative_to(root)} ({len(lines)} lines, needs {reason.strip()!r})"
                    )
    return unexplained


def test_a_module_or_script_over_500_lines_says_why_at_its_top() -> None:
    """A module or shell script is short enough to read at once, or says in one line near its top
    why it is not."""
    unexplained = long_files_without_a_reason(Path(__file__).resolve().parent.parent)
    assert not unexplained, "over 500 lines without a reason line: " + ", ".join(unexplained)


def test_the_long_file_rule_sees_a_long_shell_script(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    script = tmp_path / "benchmarks" / "long.sh"
    script.write_text("#!/usr/bin/env bash\n" + "true\n" * LONG_MODULE_LINES, encoding="utf-8")
    assert long_files_without_a_reason(tmp_path) == [
        "benchmarks/long.sh (501 lines, needs '# Long script:')"
    ]
    script.write_text(
        "#!/usr/bin/env bash\n# Long script: one budget for all stages\n" + "true\n" * 500,
        encoding="utf-8",
    )
    assert long_files_without_a_reason(tmp_path) == []
