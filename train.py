"""Train a federated experiment: ``python train.py --config configs/<experiment>.yaml [overrides]``."""

from fl_lightning.startup.heap import long_lived

# What the imports create lives as long as the process: not traversed by the cyclic collector (see heap.py).
with long_lived():
    from fl_lightning.cli import command

if __name__ == "__main__":
    raise SystemExit(command())
