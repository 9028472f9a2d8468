"""plumbing/flags.py - train.py's command line (a reader of the method may skip it).

`parse_config` turns the flags into train.py's Config: one flag per dataclass field
(underscores -> dashes, both spellings accepted), parsed by transformers' HfArgumentParser, with
the precedence flag > preset > the algorithm's default > the dataclass default, and a --help that
states each flag's real default and what each preset sets. `recipe` is the part of a Config that
shapes training, logged at the start of a run. `--print-config` (like --help, it ends the
command) checks every input as a run would, prints the resolved configuration as JSON, each value
with where it came from (`sources`), and exits 0 without loading a model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

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
    parser.add_argument("--print-config", action="store_true", help="check every input as a run would, print the "
                        "resolved configuration (JSON: each value and where it came from) and exit 0, loading no model")
    given = parser.parse_args(argv)  # first pass: which algorithm and preset
    preset = {**algo_defaults[given.algo], **presets[given.preset]}
    if given.algo == "ppo":
        preset.update(preset_ppo.get(given.preset, {}))
    parser.set_defaults(**preset)
    if given.preset == "paper":
        # The official code trains think mode turn by turn: each agent turn its own sample with
        # the dialogue's reward, earlier thoughts dropped from the history (docs/PAPER_SETUP.md, "Think mode").
        parser.set_defaults(per_turn_samples=parser.parse_args(argv).think)
    values = vars(parser.parse_args(argv))
    show = values.pop("print_config")
    cfg = config_cls(**values)
    if show:
        print_config(cfg, sources(parser, argv, values, presets, algo_defaults, preset_ppo))
    return cfg


def sources(parser, argv, values: dict, presets: dict, algo_defaults: dict, preset_ppo: dict) -> dict:
    """Where each of the parsed `values` came from: flag | preset | preset with ppo | algorithm |
    default (a flag given beats everything; the paper preset's per-turn rows follow --think)."""
    argv = sys.argv[1:] if argv is None else argv
    given = {parser._option_string_actions[a.split("=")[0]].dest for a in argv
             if a.startswith("--") and a.split("=")[0] in parser._option_string_actions}
    preset, algo = values["preset"], values["algo"]
    out = {}
    for f in values:
        if f in given:
            out[f] = "flag"
        elif preset == "paper" and f == "per_turn_samples":
            out[f] = "preset paper (follows --think)"
        elif algo == "ppo" and f in preset_ppo.get(preset, {}):
            out[f] = f"preset {preset} with ppo"
        elif f in presets[preset]:
            out[f] = f"preset {preset}"
        elif f in algo_defaults[algo]:
            out[f] = f"algorithm {algo}"
        else:
            out[f] = "default"
    return out


def print_config(cfg, where: dict):
    """--print-config: every input checked as a run checks it (plumbing.checks.validate and the
    simulated user's flags; a bad one is the run's one-line error, exit 2), then the configuration
    as JSON, {flag: {"value", "from"}}, and exit 0. No model, reader or server is loaded."""
    from plumbing.backends import make_backend
    from plumbing.checks import InputError, validate
    from plumbing.reader import reader_problem
    try:
        validate(cfg)
        make_backend(cfg, seed=cfg.seed)  # the simulator's flags, without loading the rule user's reader
        if cfg.simulator == "rule" and reader_problem(cfg.user_reader):
            raise InputError(reader_problem(cfg.user_reader))
    except (InputError, ValueError) as e:
        sys.stderr.write(f"train.py: error: {e}\n")
        raise SystemExit(2) from None
    print(json.dumps({k: {"value": v, "from": where.get(k, "default")} for k, v in dataclasses.asdict(cfg).items()},
                     indent=1))
    raise SystemExit(0)


def default_note(action, presets: dict, algo_defaults: dict, preset_ppo: dict) -> str:
    """' (default: X; ...)' for a flag's --help: its default and what the algorithms and presets set."""
    name = action.dest
    default = "data/scenarios_train.jsonl" if name == "scenarios" else action.default
    notes = [f"default: {default}" if default != "" else "default: empty"]
    if name in algo_defaults["grpo"]:
        notes = ["default: " + ", ".join(f"{values[name]} with --algo {algo}"
                                         for algo, values in algo_defaults.items())]
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
