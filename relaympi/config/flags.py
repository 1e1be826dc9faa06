"""A RunConfig field's flag: its one text, how the command line takes it, where it applies.

Where an algorithm's option applies is not written here: a flag that is a field of some
algorithm's options (relaympi.algorithms.options) applies to exactly those algorithms, and its rule,
its refusal and the "--algo X only" that starts its text are derived from them (``rules``,
``text``). Everything else that limits a flag is an ``Applies`` rule of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relaympi.algorithms.options import option_names, purpose
from relaympi.algorithms.registry import ALGORITHM_OPTIONS

# a run's config as a dict (RunConfig.to_dict(), or a run file's `config`)
Settings = Mapping[str, Any]


class ConfigError(ValueError):
    """A bad flag value or combination; the CLI exits with status 2.

    The message names the flag and says what it accepts, e.g. "--alpha must be > 0 ...".
    """


@dataclass(frozen=True)
class Applies:
    """Where a flag applies: ``holds(config)``; elsewhere ``why(config)`` says why it cannot.

    ``refuse``: a value given where it does not hold is refused (``not_applicable``).
    ``identity``: where it does not hold, the key is no part of the experiment
    (``experiment_settings``).
    """

    holds: Callable[[Settings], bool]
    why: Callable[[Settings], str] = lambda c: ""
    refuse: bool = True
    identity: bool = True


@dataclass(frozen=True)
class Flag:
    """How a RunConfig field appears on the command line, in a run's identity and in the flag table.

    Everything a new flag of `python -m relaympi.train` needs besides its field: the parser, the
    refusal of flags that cannot apply, the experiment's identity (``numbers``), what a resumed run
    may change (``resume_free``) and the flag table are generated from these.
    """

    # the flag's one text, every default in it (a callable: computed when it is shown); code is
    # marked `so`: the flag table shows it as Markdown, --help without the backticks
    help: str | Callable[[], str]
    # argparse's type (None: a string, or an on/off switch)
    type: Callable[[str], Any] | None = None
    # the allowed values (imported when the parser is built)
    choices: Callable[[], Sequence[str]] | None = None
    # the value's name in --help and the table (None: argparse's, the field's name in capitals)
    metavar: str | None = None
    # an on/off flag: given, it stores the opposite of the field's default
    switch: bool = False
    # an on/off pair: --name stores True, --no-name False (argparse.BooleanOptionalAction)
    negatable: bool = False
    option: str | None = None  # the option string (None: --name-with-dashes)
    group: str | None = None  # the --help group it is listed in
    # whether it can change a run's numbers (False: part of NON_SEMANTIC_KEYS)
    numbers: bool = True
    # whether a resumed run may change it (where output goes, how work is spread)
    resume_free: bool = False
    # where it applies besides an algorithm's options' rule (everywhere when empty)
    applies: tuple[Applies, ...] = ()

    def option_string(self, name: str) -> str:
        return self.option or "--" + name.replace("_", "-")

    def metavar_of(self, name: str) -> str:
        """The value's name as --help shows it."""
        return self.metavar or name.upper()


def flag_field(default: Any, help: str | Callable[[], str], **flag: Any) -> Any:
    """A RunConfig field and its command-line Flag."""
    return field(default=default, metadata={"flag": Flag(help=help, **flag)})


def algorithms_taking(name: str) -> tuple[str, ...]:
    """The algorithms whose options have field ``name`` (empty: no algorithm's option)."""
    return tuple(
        algo for algo, options in ALGORITHM_OPTIONS.items() if name in option_names(options)
    )


def _algorithm_rule(name: str, algos: tuple[str, ...]) -> Applies:
    """Where an algorithm's option applies: its algorithms. The refusal says what it does (its
    ``purpose``) where it has one: "it sizes RelaySum's message chunks (relay, relay-grad), not
    used by sgp", else "it applies to --algo relay only, not sgp"."""
    what = next(purpose(ALGORITHM_OPTIONS[a], name) for a in algos)
    which = f"--algo {algos[0]}" if len(algos) == 1 else ", ".join(algos)
    if what:
        return Applies(
            lambda c: c.get("algo") in algos,
            lambda c: f"{what} ({which}), not used by {c.get('algo')}",
        )
    return Applies(
        lambda c: c.get("algo") in algos,
        lambda c: f"it applies to --algo {'/'.join(algos)} only, not {c.get('algo')}",
    )


def rules(name: str, flag: Flag) -> tuple[Applies, ...]:
    """Every rule of where field ``name``'s flag applies: its algorithms' (an algorithm's option),
    then its own."""
    algos = algorithms_taking(name)
    return ((_algorithm_rule(name, algos),) if algos else ()) + flag.applies


def text(name: str, flag: Flag) -> str:
    """The flag's text (Markdown: code in backticks); an algorithm's option's starts with its
    algorithms."""
    words = flag.help() if callable(flag.help) else flag.help
    algos = algorithms_taking(name)
    return (f"`--algo {'/'.join(algos)}` only: " if algos else "") + words


def plain(markdown: str) -> str:
    """A flag's text as --help shows it: the backticks that mark code dropped (and % as argparse
    needs it)."""
    return re.sub(r"`([^`]*)`", r"\1", markdown).replace("%", "%%")
