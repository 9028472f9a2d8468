"""plumbing/flags.py - train.py's command line (a reader of the method may skip it).

`parse_config` turns the flags into train.py's Config: one flag per dataclass field
(underscores -> dashes, both spellings accepted), parsed by transformers' HfArgumentParser, with
the precedence flag > preset > the algorithm's default > the dataclass default, and a --help that
states each flag's real default and what each preset sets. `recipe` is the part of a Config that
shapes training, logged at the start of a run.
"""
from __future__ import annotations

import argparse
import dataclasses

from transformers import HfArgumentParser


def parse_config(config_cls, presets: dict, algo_defaults: dict, preset_ppo: dict, argv=None, description: str = ""):
    """argv -> a `config_cls` (train.Config). `presets` (train.PRESETS), `algo_defaults`
    (train.ALGO_DEFAULTS: group_size per algorithm) and `preset_ppo` (train.PRESET_PPO: what a
    preset changes for PPO) are the defaults a flag overrides."""
    parser = HfArgumentParser(config_cls, description=description, formatter_class=argparse.HelpFormatter)
    for f in dataclasses.fields(config_cls):
        if f.default is False:  # a bool a preset may turn on: --no-X turns it off again
            parser.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false",
                                help=argparse.SUPPRESS)
    for action in parser._actions:  # --help states each real default and what the presets set
        if action.option_strings[0].startswith("--no"):
            action.help = argparse.SUPPRESS  # listed with its flag: "--think (...; off: --no-think)"
        elif action.dest in config_cls.__dataclass_fields__:
            action.help += default_note(action, presets, algo_defaults, preset_ppo)
            action.option_strings.sort(key=lambda flag: "_" in flag)  # --actor-lr first, then --actor_lr
    given = parser.parse_args(argv)  # first pass: which algorithm and preset
    preset = {**algo_defaults[given.algo], **presets[given.preset]}
    if given.algo == "ppo":
        preset.update(preset_ppo.get(given.preset, {}))
    parser.set_defaults(**preset)
    if given.preset == "paper":
        # The official code trains think mode turn by turn: each agent turn its own sample with
        # the dialogue's reward, earlier thoughts dropped from the history (docs/PAPER_SETUP.md, "Think mode").
        parser.set_defaults(per_turn_samples=parser.parse_args(argv).think)
    return config_cls(**vars(parser.parse_args(argv)))


def default_note(action, presets: dict, algo_defaults: dict, preset_ppo: dict) -> str:
    """' (default: X; ...)' for a flag's --help: its default and what the algorithms and presets set."""
    name = action.dest
    default = "data/scenarios_train.jsonl" if name == "scenarios" else action.default
    notes = [f"default: {default}" if default != "" else "default: empty"]
    if name in algo_defaults["grpo"]:
        notes = ["default: " + ", ".join(f"{values[name]} with --algo {algo}" for algo, values in algo_defaults.items())]
    for preset in presets:
        if name in presets[preset]:
            notes.append(f"{preset} preset: {presets[preset][name]}")
        if name in preset_ppo.get(preset, {}):
            notes.append(f"{preset} preset with ppo: {preset_ppo[preset][name]}")
    if isinstance(default, bool):
        notes.append(f"off: --no-{name.replace('_', '-')}")
    return " (" + "; ".join(notes) + ")"


def recipe(cfg) -> dict:
    """Every value that shapes training (the bookkeeping flags left out): logged at the start,
    so a run states its recipe."""
    bookkeeping = {"preset", "algo", "output_dir", "resume", "save_every", "keep_last", "report_to",
                   "simulator_api_key_env", "scenarios"}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in bookkeeping}
