"""Train a federated experiment: ``python train.py --config configs/fedavg_digits.yaml [overrides]``."""

from fl_lightning.cli import main

if __name__ == "__main__":
    main()
