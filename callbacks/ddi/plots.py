"""The Deep Domain Isolation scatter: per-sample gradients projected to 2-D, coloured by domain, marked by cluster."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the non-interactive backend
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from fl_lightning.ops.domain_isolation import ClientFeatures  # noqa: E402

MARKERS = "o^sDvP*X"


def plot_gradient_scatter(
    features: Sequence[ClientFeatures], clusters: Sequence[Tensor], domains: Sequence[Tensor | None], path: Path
) -> None:
    """PCA of the (pruned, normalised) gradients of the class present in most samples, one point per sample.

    Args:
        features: Every client's DDI features.
        clusters: Per client, the cluster id of each sample.
        domains: Per client, the true domain of each sample (None when unknown: points coloured by cluster).
        path: PNG to write.
    """
    present = torch.cat([f.present for f in features])
    c = int(present.sum(0).argmax())  # background, on the digit task: every sample has it
    x = torch.cat([f.features[c] for f in features])[present[:, c]]
    cluster = torch.cat(list(clusters))[present[:, c]]
    known = all(d is not None for d in domains)
    colour = torch.cat(list(domains))[present[:, c]] if known else cluster
    x = x - x.mean(0)
    _, _, v = torch.pca_lowrank(x, q=min(2, *x.shape), center=False)
    xy = (x @ v[:, :2]).numpy() if v.shape[1] >= 2 else torch.cat([x @ v, torch.zeros(len(x), 1)], 1).numpy()
    fig, ax = plt.subplots(figsize=(5, 4))
    for m in cluster.unique().tolist():
        sel = (cluster == m).numpy()
        top = max(1, int(colour.max()))
        ax.scatter(xy[sel, 0], xy[sel, 1], c=colour[sel].numpy(), cmap="coolwarm", vmin=0, vmax=top,
                   marker=MARKERS[m % len(MARKERS)], s=14, label=f"cluster {m}")  # fmt: skip
    ax.set_title(f"DDI gradients of class {c} (PCA); colour: {'true domain' if known else 'cluster'}")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
