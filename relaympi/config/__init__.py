"""Typed, validated run configuration and the command line of `python -m relaympi.train`.

    flags        Flag (a field's one text, how the command line takes it), Applies (where it
                 applies), ConfigError; an algorithm's options say themselves where they apply
    run_config   RunConfig: every field with its flag; FLAGS, NON_SEMANTIC_KEYS, RESUME_FREE_KEYS
    help_text    the parts of the texts that come from the tasks and algorithms (their defaults)
    applies      refusals of flags that cannot apply, and the settings of a run's experiment
    validation   validate(): every check that needs no topology or data
    parser       build_parser(), parse_args() and flag_table()

Import from here: ``from relaympi.config import RunConfig, parse_args``. Torch-free: the report
reads run configurations (experiment_settings) where torch may not be installed.
"""

from __future__ import annotations

from relaympi.config.applies import experiment_settings, not_applicable
from relaympi.config.flags import Applies, ConfigError, Flag, Settings, flag_field
from relaympi.config.parser import CONFIG, build_parser, flag_table, parse_args
from relaympi.config.run_config import (
    AUTOCAST_DTYPES,
    BACKENDS,
    FLAGS,
    MAX_SEED,
    NON_SEMANTIC_KEYS,
    PLACEMENTS,
    RESUME_FREE_KEYS,
    RunConfig,
    flags_of,
    run_file_config_keys,
)
from relaympi.config.validation import validate

__all__ = [
    "AUTOCAST_DTYPES",
    "BACKENDS",
    "CONFIG",
    "FLAGS",
    "MAX_SEED",
    "NON_SEMANTIC_KEYS",
    "PLACEMENTS",
    "RESUME_FREE_KEYS",
    "Applies",
    "ConfigError",
    "Flag",
    "RunConfig",
    "Settings",
    "build_parser",
    "experiment_settings",
    "flag_field",
    "flag_table",
    "flags_of",
    "not_applicable",
    "parse_args",
    "run_file_config_keys",
    "validate",
]
