"""Command line: `python -m fasttrain [--recipe NAME] [--flag=value ...]` (also under torchrun), and
`python -m fasttrain selfcheck [--out FILE]` (fasttrain/selfcheck/).

User errors (a bad flag, a missing directory, a corrupt shard or checkpoint) end with one line on
stderr and no traceback: exit code 2 for flags and configuration, 1 for data and checkpoints.

Nothing here imports torch before fasttrain.threads.configure has set the CPU thread policy (torch's
OpenMP runtime reads its wait policy once, when it loads): the flags are parsed first (fasttrain.flags
imports no torch), then the policy is applied for the run's input workers, then the trainer imported.
"""

from __future__ import annotations

import os
import sys
import warnings

from fasttrain.errors import exit_code, print_error


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # Ctrl-C before the trainer's own handler (importing torch, building data)
        sys.stderr.write("fasttrain: interrupted before training began; nothing was written to resume from\n")
        return 130


def _main(argv: list[str]) -> int:
    if argv[:1] == ["selfcheck"]:  # `python -m fasttrain selfcheck`: fasttrain/selfcheck.py
        from fasttrain.selfcheck import main as selfcheck

        sys.stdout.reconfigure(line_buffering=True)
        return selfcheck(argv[1:])
    from fasttrain.config import ConfigError
    from fasttrain.flags import parse_command_line

    # Progress lines must reach a log file or a pipe as they happen, not when a buffer fills.
    sys.stdout.reconfigure(line_buffering=True)
    try:
        cfg, chosen = parse_command_line(argv)
    except ConfigError as err:
        # Every rank parses the same flags: under torchrun one line per node, not one per rank.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print_error(err)
        return 2
    except BrokenPipeError:  # `--help | head`: the reader went away, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    from fasttrain.threads import configure

    def workers() -> int:  # called by configure once torch is imported: --num_workers auto asks it
        from fasttrain.data import startup_workers

        return startup_workers(cfg)

    policy = configure(workers)
    if os.environ.get("RANK", "0") == "0":  # stdout: stderr is kept for the one line of an error
        print(f"fasttrain: {policy.describe()}")
        if chosen:  # the recipe a seed's flags selected (fasttrain.flags.seed_recipe)
            print(chosen)
        if cfg.num_gpus:  # rank 0 only, as fasttrain.flags' notes: every rank parses the flags
            print(f"fasttrain: note: {_num_gpus_note(cfg.num_gpus)}", file=sys.stderr)
    # torch's DataLoader warns of more workers than cores each time it builds its workers (once per
    # epoch and per evaluation, from two lines of its code): once is enough.
    warnings.filterwarnings("once", message="This DataLoader will create", category=UserWarning)
    from fasttrain.distributed import cleanup
    from fasttrain.train import train

    try:
        train(cfg)
    except Exception as err:
        if (code := exit_code(err)) is None:
            raise
        print_error(err)
        return code
    finally:
        # Leave the process group on the error paths too: a gloo group still alive while Python
        # exits aborted a rank ("terminate called without an active exception", SIGABRT) after its
        # one-line error, and torchrun then reported that instead of the error.
        cleanup()
    return 0


def _num_gpus_note(gpus: int) -> str:
    """What --num_gpus does here; the torchrun advice only where this node's process count (torchrun's
    LOCAL_WORLD_SIZE, 1 without it) is not the seed's GPU count: a torchrun launch of that many is right."""
    processes = os.environ.get("LOCAL_WORLD_SIZE", "1")
    said = f"--num_gpus={gpus} is accepted for the seeds' command lines but does not set the device count"
    if processes == str(gpus):
        return f"{said}: this node's {processes} process(es) (torchrun's --nproc_per_node) are its devices"
    return f"{said} (this node runs {processes} process(es)); launch with torchrun --nproc_per_node={gpus}"


if __name__ == "__main__":
    sys.exit(main())
