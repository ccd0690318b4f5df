"""`batchgen` and `python -m batchgen`. A Ctrl-C while the command line is still being
imported ends the process with one line (exit 130), as it does once a command runs, not
with a traceback from inside an import."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

INTERRUPTED = "batchgen: interrupted"  # a command stopped by Ctrl-C before it did any work


def _interrupted(signum: int, frame: Any) -> None:
    sys.stderr.write(f"\n{INTERRUPTED}\n")
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def main() -> None:
    previous = signal.signal(signal.SIGINT, _interrupted)
    from batchgen.cli import main as command_line

    signal.signal(signal.SIGINT, previous)  # each command sets its own from here on
    command_line()


if __name__ == "__main__":  # importing the module runs nothing
    main()
