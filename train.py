"""Train a federated experiment: ``python train.py --config configs/<experiment>.yaml [overrides]``."""

import sys

from fl_lightning.startup import early_ranks
from fl_lightning.startup.heap import long_lived

if __name__ == "__main__":
    # Before torch and Lightning load: with --federation.workers=N the other ranks import them alongside this one.
    early_ranks.start(sys.argv[1:])

# What the imports create lives as long as the process: not traversed by the cyclic collector (see heap.py).
with long_lived():
    from fl_lightning.cli import main

if __name__ == "__main__":
    main()
