"""Where each flag applies: the refusal of a flag given where it cannot (``not_applicable``) and
the settings that make up a run's experiment (``experiment_settings``). Torch-free: the report
reads run configurations where torch may not be installed."""

from __future__ import annotations

from typing import Any

from relaympi.config import run_config
from relaympi.config.flags import rules
from relaympi.config.run_config import NON_SEMANTIC_KEYS, RUN_FILE_ONLY_KEYS, RunConfig

# what runs did before their run files recorded a key (a default that changed since)
_BEFORE_RECORDED = {"placement": "ranks"}  # the paper's rank order, the only one before --placement


def experiment_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that define a run's experiment (seed included), from a run file's config.

    Missing keys (older files) take RunConfig's defaults; keys that cannot apply to the run's
    algorithm or task are dropped, so `--relay-mode counts` on dpsgd is the same experiment as none.
    """
    defaults = RunConfig().to_dict()
    merged = {**defaults, **_BEFORE_RECORDED, **config}
    # run_config.FLAGS read at each call: a test may add a flag
    identity = {
        f.name: [rule for rule in rules(f.name, flag) if rule.identity]
        for f, flag in run_config.FLAGS
    }
    return {
        key: value
        for key, value in merged.items()
        if key not in NON_SEMANTIC_KEYS
        and key not in RUN_FILE_ONLY_KEYS
        and all(rule.holds(merged) for rule in identity.get(key, ()))
    }


def not_applicable(cfg: RunConfig) -> list[tuple[str, str]]:
    """(flag, why) for every given flag that cannot change this run (refused, not ignored)."""
    settings = cfg.to_dict()
    found = []
    for f, flag in run_config.FLAGS:
        value = getattr(cfg, f.name)
        if value is None or value == f.default:  # not given
            continue
        found += [
            (flag.option_string(f.name), rule.why(settings))
            for rule in rules(f.name, flag)
            if rule.refuse and not rule.holds(settings)
        ]
    return found
