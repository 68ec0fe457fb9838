"""Output of the torchrun worker scripts."""

import os
import sys


def say(line: str) -> None:
    """Print one line with a single write: print() writes the text and the newline separately, so another rank's
    output could land between them and hide a 'PASS' mark from the test's pattern."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def run_worker(main) -> None:
    """Run a worker's checks, then leave the process group; exit 1 with the traceback on any failure."""
    import traceback

    import torch.distributed as dist

    from parallel.distributed import exit_process

    try:
        main()
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        exit_process(1)
    exit_process(0)
