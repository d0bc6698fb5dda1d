"""Process start-up helpers: a lighter import of torchmetrics, and no cyclic collection while Lightning loads."""
