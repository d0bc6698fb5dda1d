"""The conditional GAN of FedER's first phase: shapes, budget, seeding, RNG isolation, the privacy term's effect."""

from functools import partial

import pytest
import torch

from callbacks.feder.gan import ConditionalDiscriminator, ConditionalGenerator
from callbacks.feder.private_gan import PrivateGANConfig, train_private_gan
from tests.conftest import tiny_data


@pytest.mark.parametrize("size", [(8, 8), (16, 16), (28, 28), (12, 16)])
@pytest.mark.parametrize("channels", [1, 3])
def test_networks_are_sized_for_the_data(size, channels):
    g = ConditionalGenerator(10, channels, size, latent_dim=8, width=4)
    d = ConditionalDiscriminator(10, channels, size, width=4)
    y = torch.tensor([0, 3, 9])
    x = g(torch.randn(3, 8), y)
    assert x.shape == (3, channels, *size) and x.min() >= 0 and x.max() <= 1
    assert d(x, y).shape == (3,)


def test_sizes_the_blocks_cannot_produce_are_refused():
    with pytest.raises(ValueError, match="ConditionalGenerator.*divisible by 4"):
        ConditionalGenerator(10, 1, (10, 10))
    with pytest.raises(ValueError, match="ConditionalDiscriminator"):
        ConditionalDiscriminator(10, 1, (6, 8))


def test_budget_scales_with_the_data():
    cfg = PrivateGANConfig(epochs=40, batch_size=64)
    assert cfg.num_steps(479) == 300 and cfg.num_steps(24) == 15 and PrivateGANConfig(epochs=0.01).num_steps(5) == 1


def train(data, seed=0, alpha=0.0, distance=None):
    split = data.client_data("site0")
    cfg = PrivateGANConfig(epochs=2, batch_size=8, privacy_weight=alpha, privacy_pairs=4)
    return train_private_gan(
        split.train_x, split.train_y, data.num_classes, cfg, seed=seed, distance=distance,
        make_generator=partial(ConditionalGenerator, latent_dim=4, width=4),
        make_discriminator=partial(ConditionalDiscriminator, width=4),
    )  # fmt: skip


def test_training_is_seeded_and_leaves_the_callers_rng_alone(monkeypatch):
    data = tiny_data()
    monkeypatch.setattr(PrivateGANConfig, "build_distance", lambda self: pytest.fail("α = 0 needs no LPIPS"))
    before = torch.get_rng_state()
    a, b, c = train(data), train(data), train(data, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert not a.training and next(a.parameters()).device.type == "cpu"


def test_the_privacy_term_changes_what_the_generator_learns():
    from callbacks.feder.perceptual import PerceptualDistance

    data = tiny_data()
    plain, private = train(data), train(data, alpha=1.0, distance=PerceptualDistance())
    assert not torch.equal(plain.state_dict()["blocks.3.weight"], private.state_dict()["blocks.3.weight"])
