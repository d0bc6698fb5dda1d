"""Risk networks for Cox models: a linear score x·β or a one-hidden-layer MLP, one risk per row."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

CoxArch = Literal["linear", "mlp"]
COX_ARCHITECTURES = ("linear", "mlp")


class CoxNet(nn.Module):
    """Feature rows (N, F) → risk scores (N,): ``classifier(features(x))``, the output layer without a bias.

    A constant added to every risk cancels in the partial likelihood (it multiplies every term of a risk set by the
    same factor), so an output bias would never be trained: it is left out. ``features`` and ``classifier`` are the
    representation contract methods such as MOON use (``features`` is the identity of a linear model).

    Args:
        num_features: Feature columns F.
        arch: ``linear`` (the Cox model, r = x·β) or ``mlp`` (one hidden layer of ``width`` ReLU units).
        width: Hidden units of the MLP (unused by ``linear``).

    Raises:
        ValueError: On an unknown ``arch`` or a size below 1, naming the config key.
    """

    def __init__(self, num_features: int, arch: CoxArch = "linear", width: int = 32) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"model.init_args.num_features must be >= 1, got {num_features}")
        if arch == "linear":
            self.features: nn.Module = nn.Flatten()
            self.classifier = nn.Linear(num_features, 1, bias=False)
        elif arch == "mlp":
            if width < 1:
                raise ValueError(f"model.init_args.width must be >= 1, got {width}")
            self.features = nn.Sequential(nn.Flatten(), nn.Linear(num_features, width), nn.ReLU())
            self.classifier = nn.Linear(width, 1, bias=False)
        else:
            raise ValueError(f"model.init_args.arch must be one of {', '.join(COX_ARCHITECTURES)}, got {arch!r}")

    def forward(self, x: Tensor) -> Tensor:
        """Risk scores, shape (N,)."""
        return self.classifier(self.features(x)).squeeze(-1)
