"""Kinds of torch layers by their public classes: what a method looks for in a user's network.

torch's shared base classes of these layers (``_BatchNorm``, ``_InstanceNorm``, ``_NormBase``, ``_ConvNd``) are
private; these tuples name the public classes instead (the lazy ones too: they become the plain ones on their first
forward pass).
"""

from __future__ import annotations

from torch import nn

BATCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
)  # fmt: skip
INSTANCE_NORMS: tuple[type[nn.Module], ...] = (
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d,
)  # fmt: skip
CONVS: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.LazyConv1d, nn.LazyConv2d, nn.LazyConv3d,
    nn.LazyConvTranspose1d, nn.LazyConvTranspose2d, nn.LazyConvTranspose3d,
)  # fmt: skip


def tracks_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` is a batch or instance norm that keeps running statistics (buffers a forward pass updates)."""
    return isinstance(module, BATCH_NORMS + INSTANCE_NORMS) and bool(module.track_running_stats)
