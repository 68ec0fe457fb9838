"""The entry points' config step: `--config FILE [key=value ...]` to a checked Config, or one line and exit code 2."""

from __future__ import annotations

import os

import yaml

from config.checks import check_ppo
from config.help import describe_schema
from config.loading import check_given_once, load_config, to_dict
from config.schema import Config, ConfigError

CONFIG_ERROR_GRACE_S = 5.0


def parse_or_exit(argv: list[str], world_size: int, rank: int, check=None) -> Config:
    """`--config PATH [key=value ...]` -> a checked Config. On a mistake, rank 0 prints one line and every rank
    exits with code 2 (the others CONFIG_ERROR_GRACE_S later), before any process group or model exists. `--help`
    lists every key (`describe_schema`); `--print-config` prints the checked config as YAML on rank 0 and exits 0
    on every rank."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        description="meshrl: PPO/GRPO on DeviceMesh pools\n\n"
                    "overrides: KEY=VALUE with a dotted key (actor.optim.lr=1e-6) and a YAML value (true, null, "
                    "[1, 2], {spec: gsm8k}),\napplied over --config FILE; a top-level `base: other.yaml` in FILE "
                    "(relative to it) is read first and FILE updates it."
                    + ("\n\nplanner: --plan [--world N] [--gpu-memory GiB] [--suggest] [--json] prints the memory per "
                       "role and rank\nfrom the config and the models' config.json files, and a placement with "
                       "--suggest (--plan --help)" if check in (None, check_ppo) else ""),
        # the schema's listing reads config/schema.py's source (seconds): only for --help, not on every start
        epilog=describe_schema() if any(a == "-h" or (len(a) > 2 and "--help".startswith(a)) for a in argv) else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (configs/*.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the checked config (defaults, file and overrides) as YAML and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    args = parser.parse_args(argv)
    try:
        if args.config is None and not args.overrides:
            prog = os.path.basename(sys.argv[0]) or "train_ppo.py"
            raise ConfigError(f"no config given: python {prog} --config configs/quickstart.yaml [key=value ...] "
                              "(--help lists every key)")
        check_given_once(args.overrides)
        cfg = load_config(args.config, args.overrides)
        (check or check_ppo)(cfg, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every worker when the first one exits: the others give rank 0 the time to print
            # (its line went missing in 4 of 28 launches when another rank ended first)
            import time

            time.sleep(CONFIG_ERROR_GRACE_S)
        sys.exit(2)
    if args.print_config:
        if rank == 0:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="", flush=True)
        sys.exit(0)
    return cfg
