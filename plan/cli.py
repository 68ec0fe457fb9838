"""`train_ppo.py --config X --plan [--world N] [--gpu-memory GiB] [--suggest] [--json]`: the planner's command line
and exit codes."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import config as C
from plan.fixes import find_fixes
from plan.make import AUTO_MARGIN, AUTO_MARGIN_MIN, auto_budgets, auto_keys, describe_budget, make_plan
from plan.memory import row_width
from plan.models import DEFAULT_GPU_GIB, GiB, check_plan, with_values
from plan.output import describe, to_json
from plan.suggest import placement_yaml, suggest

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_CONFIG_ERROR = 0, 1, 2


def main(argv: list[str], world_env: int = 1, rank: int = 0) -> int:
    """train_ppo.py routes `--plan` here; the rest of argv is the usual --config FILE [key=value ...]."""
    parser = argparse.ArgumentParser(usage="train_ppo.py --config FILE --plan [--world N] [--gpu-memory GiB] "
                                           "[--suggest] [--json] [key=value ...]",
                                     description="The memory and placement planner: bytes per role and per rank, "
                                                 "each rank's peak against the GPU, the config keys that would make "
                                                 "it fit (plan/__init__.py's docstring has the formulas).",
                                     epilog="exit codes: 0 fits (--suggest: placement found), 1 does not fit (none "
                                            "found), 2 config error; `train_ppo.py --help` lists the config keys")
    parser.add_argument("--plan", action="store_true", help="plan memory and placement; no weights, no processes")
    parser.add_argument("--world", type=int, metavar="N",
                        help="ranks to plan for (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--gpu-memory", type=float, metavar="GiB",
                        help=f"memory per GPU (default: this machine's GPU, else {DEFAULT_GPU_GIB:g})")
    parser.add_argument("--suggest", action="store_true", help="print a placement: block for the world size")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (per-rank peak_bytes)")
    args, rest = parser.parse_known_args(argv)
    world = args.world if args.world is not None else world_env
    for flag, value in (("--world", world), ("--gpu-memory", args.gpu_memory)):
        if value is not None and not value > 0:
            if rank == 0:
                print(f"config error: {flag} {value}: must be > 0", file=sys.stderr, flush=True)
            return EXIT_CONFIG_ERROR
    cfg = C.parse_or_exit(rest, world, rank, check=check_plan)
    if args.gpu_memory is not None:
        gpu, source = int(args.gpu_memory * GiB), "--gpu-memory"
    else:
        import torch

        if torch.cuda.is_available():
            gpu, source = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
        else:
            gpu, source = int(DEFAULT_GPU_GIB * GiB), "no GPU here: the default; set --gpu-memory"
    placement = None
    if args.suggest:
        placement = suggest(cfg, world, gpu)
        if placement is not None:
            cfg = with_values(cfg, [("placement", placement)])
    # micro_batch_tokens=auto: what the run would pick on GPUs with this much free memory
    budgets = auto_budgets(cfg, world, gpu) if auto_keys(cfg) else {}
    cfg = with_values(cfg, [(f"{s}.micro_batch_tokens", t) for s, (t, _) in budgets.items()])
    plan = make_plan(cfg, world, gpu)
    fixes = find_fixes(cfg, plan)
    code = EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT
    if args.suggest:
        code = EXIT_FITS if placement is not None else EXIT_DOES_NOT_FIT
    if rank != 0:
        return code
    if args.json:
        out = to_json(plan, fixes, placement)
        out["auto_budgets"] = {f"{s}.micro_batch_tokens": {"tokens": t, "pools": [asdict(b) for b in pools]}
                               for s, (t, pools) in budgets.items()}
        print(json.dumps(out, indent=1))
        return code
    print(describe(cfg, plan, fixes, source))
    if budgets:
        print(f"\nmicro-batch budgets set to auto (a GPU of {gpu / GiB:.1f} GiB taken as free at start; the run "
              f"measures its own, less {AUTO_MARGIN}%, {AUTO_MARGIN_MIN / GiB:g} GiB at least):")
        for s, (tokens, pools) in budgets.items():
            print("  " + describe_budget(s, tokens, pools, row_width(cfg), cfg.run.device == "cpu"))
    if args.suggest and placement is None:
        print(f"\nno placement fits {world} ranks of {gpu / GiB:.1f} GiB: the fixes above, a larger --world or "
              "larger GPUs")
    elif args.suggest:
        print(f"\n# suggested for {world} ranks of {gpu / GiB:.1f} GiB: paste into the config\n"
              + placement_yaml(placement), end="")
    return code
