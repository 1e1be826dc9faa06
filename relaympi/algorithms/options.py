"""Each algorithm's options, and the algorithms' error: the torch-free part of their interface.

An algorithm's options are a frozen dataclass (``Options``); the registry
(relaympi.algorithms.registry) names each algorithm's. Every field is the RunConfig field, and so
the flag, of the same name: ``relay_chunk`` is ``--relay-chunk``. A flag that is some algorithm's
option applies to exactly the algorithms whose options have it; relaympi.config derives its
refusals and the experiment's identity from these classes, without torch (the report reads run
configurations where torch may not be installed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

OptionsT = TypeVar("OptionsT", bound="Options")


class AlgorithmError(ValueError):
    """An invalid algorithm/topology/optimizer combination; the message names the allowed
    choices."""


def option(default: Any, purpose: str = "") -> Any:
    """An option's field.

    Args:
        default: the option's value when the run does not set it.
        purpose: what it does, as the refusal of its flag for another algorithm says it ("it sizes
            RelaySum's message chunks (relay, relay-grad), not used by sgp"); without one the
            refusal says "it applies to --algo relay only, not sgp".

    Returns:
        A dataclass field that carries ``purpose`` in its metadata.
    """
    return field(default=default, metadata={"purpose": purpose})


def purpose(options: type[Options], name: str) -> str:
    """The ``purpose`` of option ``name`` of ``options``.

    Args:
        options: an Options class.
        name: one of its fields.

    Returns:
        What the option does ("" where it has no purpose).
    """
    return next(f.metadata.get("purpose", "") for f in fields(options) if f.name == name)


def option_names(options: type[Options]) -> tuple[str, ...]:
    """The names of an options class's fields, which are also RunConfig fields (and flags).

    Args:
        options: an Options class.

    Returns:
        The field names, in declaration order.

    Example:
        >>> from relaympi.algorithms.options import D2Options, NoOptions
        >>> option_names(D2Options), option_names(NoOptions)
        (('d2_force', 'd2_exact_diffusion'), ())
    """
    return tuple(f.name for f in fields(options))


@dataclass(frozen=True)
class Options:
    """What the run tells an algorithm beyond its topology and optimizer. A subclass adds its
    fields with ``option`` and checks their values in ``__post_init__`` (calling super's first or
    last, so that every class of a combined options object checks its own): a bad value is a
    ValueError naming the field.

    Raises:
        ValueError: an option's value is out of range (raised by the subclass that has it).

    Example:
        ```python
        RelaySGDOptions(relay_mode="previous")
        RelaySGDOptions.of({"relay_mode": "initial", "lr": 0.1})  # other settings are ignored
        ```
    """

    def __post_init__(self) -> None:
        pass

    @classmethod
    def of(cls: type[OptionsT], settings: Mapping[str, Any] | Options) -> OptionsT:
        """These options from a run's settings or from the same-named fields of other options.

        Args:
            settings: a run's settings (RunConfig.to_dict(), a run file's config) or another
                options object; a missing or None value takes the default.

        Returns:
            An instance of this class.

        Raises:
            ValueError: a value out of range.
        """
        given = settings if isinstance(settings, Mapping) else vars(settings)
        return cls(**{f.name: given[f.name] for f in fields(cls) if given.get(f.name) is not None})


@dataclass(frozen=True)
class NoOptions(Options):
    """An algorithm without options of its own."""


# RelaySGD's normalization under dropped messages (paper, "Robust RelaySum"): Algorithm 1's counts,
# the robust rule (a missing model replaced by the worker's previous state), or by x(0)
RELAY_MODES = ("counts", "previous", "initial")


@dataclass(frozen=True)
class RelaySumOptions(Options):
    """How RelaySum (relay, relay-grad over message passing) assembles and sends its messages;
    never the numbers.

    Attributes:
        relay_in_place: assemble and swap messages in the receive buffers (least memory).
        relay_chunk: elements per message chunk (None: relaysum.DEFAULT_CHUNK), >= 1.
    """

    # assemble and swap messages in the receive buffers (least memory)
    relay_in_place: bool = option(False, "it changes RelaySum's buffers")
    # elements per message chunk (None: relaysum.DEFAULT_CHUNK)
    relay_chunk: int | None = option(None, "it sizes RelaySum's message chunks")

    def __post_init__(self) -> None:
        if self.relay_chunk is not None and self.relay_chunk < 1:
            raise ValueError(
                f"relay_chunk must be a positive number of elements, got {self.relay_chunk}"
            )
        super().__post_init__()


@dataclass(frozen=True)
class RelaySGDOptions(RelaySumOptions):
    """RelaySGD's: RelaySum's, its normalization under dropped messages, its lr correction.

    Attributes:
        relay_mode: the normalization under dropped messages, one of RELAY_MODES: "counts"
            (Algorithm 1), "previous" (the robust rule) or "initial".
        relay_lr_correction: scale the run's lr by RelaySGD's topology correction.
    """

    relay_mode: str = option("counts", "it is RelaySGD's normalization")  # one of RELAY_MODES
    # the run's lr times RelaySGD's topology correction (the plan scales the lr)
    relay_lr_correction: bool = option(False)

    def __post_init__(self) -> None:
        if self.relay_mode not in RELAY_MODES:
            raise ValueError(
                f"unknown relay_mode {self.relay_mode!r}; choose one of {', '.join(RELAY_MODES)}"
            )
        super().__post_init__()


@dataclass(frozen=True)
class D2Options(Options):
    """D²'s choice of gossip matrix.

    Attributes:
        d2_force: run D² even if the gossip matrix's smallest eigenvalue is < -1/3.
        d2_exact_diffusion: D² with (W + I) / 2 (the paper's choice on the social network).
    """

    # run D² even if the gossip matrix's smallest eigenvalue is < -1/3
    d2_force: bool = option(False)
    # D² with (W + I) / 2 (the paper's choice on the social network)
    d2_exact_diffusion: bool = option(False)
