"""Train a federated experiment: ``python train.py --config configs/<experiment>.yaml [overrides]``."""

import sys

from fl_lightning.startup import quick_exit

if __name__ == "__main__":
    # First: its exit handler runs after every handler registered later (W&B's teardown among them).
    quick_exit.arm()

from fl_lightning.startup import early_ranks  # noqa: E402 - after the exit handler
from fl_lightning.startup.heap import long_lived  # noqa: E402

if __name__ == "__main__":
    # Before torch and Lightning load: with --federation.workers=N the other ranks import them alongside this one.
    early_ranks.start(sys.argv[1:])

# What the imports create lives as long as the process: not traversed by the cyclic collector (see heap.py).
with long_lived():
    from fl_lightning.cli import main

if __name__ == "__main__":
    main()
    quick_exit.finished()  # the run is over: the process ends without the interpreter's teardown (quick_exit.py)
