"""LPIPS as a frozen module that never downloads: the package's linear heads, a local or random backbone.

The ``lpips`` package ships its learnt linear heads (``lpips/weights/v0.1/<net>.pth``) but takes the ImageNet
backbone from torchvision, which would download it. Here the backbone is built random (``pnet_rand=True``) and
then loaded from a file the user names, or from the torch hub cache when torchvision's file is already there;
otherwise it stays random (seeded, so every node and the privacy audit measure the same distance) and a warning
says so loudly: a random-feature LPIPS still separates images, but it is not the calibrated perceptual metric.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.ops.privacy import lpips_pairwise, nearest_lpips

log = logging.getLogger(__name__)

# torchvision's ImageNet weights for each LPIPS backbone (the file names its download would use).
_TORCHVISION_WEIGHTS = {
    "alex": "AlexNet_Weights",
    "vgg": "VGG16_Weights",
    "squeeze": "SqueezeNet1_1_Weights",
}
RANDOM_BACKBONE_SEED = 0


def hub_weights_path(net: str) -> Path:
    """Where torchvision keeps the backbone's ImageNet weights once downloaded (they may be absent)."""
    import torchvision.models as tvm

    url = getattr(tvm, _TORCHVISION_WEIGHTS[net]).IMAGENET1K_V1.url
    return Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]


class PerceptualDistance(nn.Module):
    """LPIPS distances between images in [0, 1] (any channel count, any size), frozen, without downloads.

    Images are repeated to 3 channels, resized bilinearly to ``image_size`` (LPIPS's backbones need at
    least 32 px; digits are 8–28 px) and mapped to [−1, 1] before the backbone.

    Args:
        net: LPIPS backbone: ``alex`` (default, cheapest), ``vgg`` or ``squeeze``.
        backbone_weights: Path to torchvision ImageNet weights of that backbone (a ``state_dict`` file). ``None``
            looks in the torch hub cache, then falls back to a seeded random backbone with a warning.
        image_size: Side the images are resized to before the backbone.

    Attributes:
        pretrained_backbone: Whether ImageNet backbone weights were loaded (False: random backbone).

    Raises:
        FileNotFoundError: If ``backbone_weights`` names a missing file.
        ValueError: On an unknown ``net`` or an ``image_size`` too small for the backbone.

    """

    def __init__(self, net: str = "alex", backbone_weights: str | None = None, image_size: int = 32) -> None:
        super().__init__()
        import lpips

        if net not in _TORCHVISION_WEIGHTS:
            raise ValueError(f"LPIPS net must be one of {sorted(_TORCHVISION_WEIGHTS)}, got {net!r}")
        if backbone_weights is not None and not Path(backbone_weights).is_file():
            raise FileNotFoundError(f"LPIPS backbone weights not found: {backbone_weights}")
        self.net_name, self.image_size = net, image_size
        # A fixed seed for the random backbone (and nothing else): same distance on every node, in every run,
        # without touching the caller's RNG streams.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="torchvision")  # lpips's `pretrained=`
            torch.manual_seed(RANDOM_BACKBONE_SEED)
            self.lpips = lpips.LPIPS(pretrained=True, net=net, pnet_rand=True, verbose=False)
        self.pretrained_backbone = self._load_backbone(backbone_weights)
        self.requires_grad_(False)
        self.eval()
        try:
            with torch.no_grad():
                self.features(torch.zeros(1, 3, image_size, image_size))
        except RuntimeError as err:
            raise ValueError(f"LPIPS image_size={image_size} is too small for the {net!r} backbone: {err}") from err

    def _load_backbone(self, path: str | None) -> bool:
        source = Path(path) if path is not None else hub_weights_path(self.net_name)
        if not source.is_file():
            log.warning(
                "LPIPS: no ImageNet weights for the %r backbone (looked for %s); using a RANDOM backbone, so the "
                "privacy term and the audit use a random-feature perceptual distance, not calibrated LPIPS. Put "
                "torchvision's file there or pass its path (gan.lpips_weights) to use the real metric.",
                self.net_name,
                source,
            )
            return False
        state = torch.load(source, map_location="cpu", weights_only=True)
        # lpips splits torchvision's `features` into slices that keep the original indices: slice2.3.x ← features.3.x
        mapped = {k: state[f"features.{k.split('.', 1)[1]}"] for k in self.lpips.net.state_dict()}
        self.lpips.net.load_state_dict(mapped)
        log.info("LPIPS: %r backbone loaded from %s", self.net_name, source)
        return True

    @property
    def layer_weights(self) -> list[Tensor]:
        """The linear heads' channel weights w_l, one (C_l,) tensor per layer."""
        return [lin.model[-1].weight.flatten() for lin in self.lpips.lins]

    def features(self, x: Tensor) -> list[Tensor]:
        """Unit-normalised backbone activations of images ``x`` (N, C, H, W) in [0, 1], one tensor per layer."""
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        elif x.shape[1] != 3:
            raise ValueError(f"LPIPS takes 1- or 3-channel images, got {x.shape[1]} channels")
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        outs = self.lpips.net(self.lpips.scaling_layer(2 * x - 1))
        return [o / (o.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10) for o in outs]

    def pairwise(self, a: Tensor, b: Tensor) -> Tensor:
        """The (len(a), len(b)) matrix of LPIPS distances (differentiable w.r.t. both)."""
        return lpips_pairwise(self.features(a), self.features(b), self.layer_weights)

    @torch.no_grad()
    def nearest(self, queries: Tensor, pool: Tensor, batch: int = 256) -> tuple[Tensor, Tensor]:
        """Distance from each query image to its closest pool image, and that image's index (no gradients)."""
        q, p = self._batched_features(queries, batch), self._batched_features(pool, batch)
        return nearest_lpips(q, p, self.layer_weights, chunk=batch)

    @torch.no_grad()
    def matrix(self, a: Tensor, b: Tensor, batch: int = 256) -> Tensor:
        """The full (len(a), len(b)) distance matrix without gradients; each image's features computed once."""
        fa, fb = self._batched_features(a, batch), self._batched_features(b, batch)
        rows = [lpips_pairwise([f[i : i + batch] for f in fa], fb, self.layer_weights) for i in range(0, len(a), batch)]
        return torch.cat(rows)

    def _batched_features(self, x: Tensor, batch: int) -> list[Tensor]:
        parts = [self.features(x[i : i + batch]) for i in range(0, len(x), batch)]
        return [torch.cat(layer) for layer in zip(*parts)]

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        """Distances of corresponding pairs (a_i, b_i), shape (N,)."""
        fa, fb = self.features(a), self.features(b)
        return sum(
            ((x - y).pow(2) * w.view(1, -1, 1, 1)).sum(1).mean(dim=(1, 2))
            for x, y, w in zip(fa, fb, self.layer_weights)
        )
