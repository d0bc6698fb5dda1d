"""Replay batch composition and λ weighting: join_replay, the replay loaders and the client's weighted loss."""

import pytest
import torch
import torch.nn.functional as F

from callbacks.feder.replay import BufferBatches, ReplayBuffer, ReplayLoader, batch_sizes, draw_codes, generate
from fl_lightning.ops.replay import join_replay
from tests.conftest import tiny_data, tiny_model


def test_join_replay_puts_the_batch_first_and_weights_it():
    x, y = torch.rand(3, 1, 4, 4), torch.tensor([0, 1, 2])
    xr, yr = torch.rand(3, 1, 4, 4), torch.tensor([5, 6, 7])
    jx, jy, w = join_replay(x, y, xr, yr, replay_weight=0.5)
    assert torch.equal(jx, torch.cat([x, xr])) and jy.tolist() == [0, 1, 2, 5, 6, 7]
    torch.testing.assert_close(w, torch.tensor([1 / 3] * 3 + [0.5 / 3] * 3))
    with pytest.raises(ValueError, match="non-empty"):
        join_replay(x[:0], y[:0], xr, yr, 1.0)


@pytest.mark.parametrize("lam", [0.0, 1.0, 2.5])
def test_client_loss_on_a_joined_batch_is_ce_real_plus_lambda_ce_replay(lam):
    data = tiny_data()
    module = tiny_model(data).train()
    x, y = data.client_data("site0").train_x[:4], data.client_data("site0").train_y[:4]
    xr, yr = data.client_data("site1").train_x[:4], data.client_data("site1").train_y[:4]
    loss = module.training_loss(join_replay(x, y, xr, yr, lam))
    # reference: the two halves in one forward pass (BatchNorm sees the joined batch), CE of each half
    logits = module.net(torch.cat([x, xr]))
    expected = F.cross_entropy(logits[:4], y) + lam * F.cross_entropy(logits[4:], yr)
    torch.testing.assert_close(loss, expected)
    # a plain (x, y) batch keeps the plain mean cross-entropy
    torch.testing.assert_close(module.training_loss((x, y)), F.cross_entropy(module.net(x), y))


def buffer_of(n=10, offset=0.0):
    images = offset + torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 2, 2).clone()
    return ReplayBuffer(torch.arange(n) % 3, torch.zeros(n, 2), images=images)


def test_replay_loader_joins_each_batch_with_as_many_buffer_samples():
    base = [(torch.full((4, 1, 2, 2), -1.0), torch.zeros(4, dtype=torch.long)),
            (torch.full((2, 1, 2, 2), -2.0), torch.ones(2, dtype=torch.long))]  # fmt: skip
    buf = buffer_of()
    loader = ReplayLoader(base, buf, replay_weight=2.0, seed=0)
    assert len(loader) == 2
    batches = list(loader)
    for (x, y, w), (bx, by) in zip(batches, base):
        b = len(by)
        assert len(y) == 2 * b and torch.equal(x[:b], bx) and torch.equal(y[:b], by)
        values = x[b:, 0, 0, 0].long()  # replay images encode their buffer index
        assert torch.equal(y[b:], buf.labels[values])
        torch.testing.assert_close(w, torch.tensor([1 / b] * b + [2.0 / b] * b))
    again = [b[0] for b in ReplayLoader(base, buf, 2.0, seed=0)]
    assert all(torch.equal(a[0], b) for a, b in zip(batches, again))  # seeded
    plain = list(ReplayLoader(base, None, 1.0, seed=0))  # no buffer received yet: batches unchanged
    assert all(len(p) == 2 and torch.equal(p[0], b[0]) for p, b in zip(plain, base))


def test_buffer_batches_follow_the_real_loaders_sizes():
    data = tiny_data(batch_size=8)
    loader = data.client_train_loader("site0")
    sizes = batch_sizes(loader)
    assert sizes == [len(b[1]) for b in loader] and sum(sizes) == data.num_train_samples("site0")
    assert batch_sizes(data.client_train_loader("site0", steps=5)) == [8] * 5
    own = BufferBatches(buffer_of(), sizes, seed=1)
    assert [len(y) for _, y in own] == sizes and len(own) == len(sizes)


def test_latent_buffers_generate_what_image_buffers_hold():
    torch.manual_seed(0)
    from callbacks.feder.gan import ConditionalGenerator

    gen = ConditionalGenerator(3, 1, (8, 8), latent_dim=4, width=4).eval()
    z, y = draw_codes(torch.tensor([0, 2, 2]), 6, 4, seed=0)
    assert set(y.tolist()) <= {0, 2}
    images = generate(gen, z, y)
    by_images = ReplayBuffer(y, z, images=images)
    by_latents = ReplayBuffer(y, z, generator=gen)
    idx = torch.tensor([5, 0, 3])
    torch.testing.assert_close(by_latents.take(idx)[0], by_images.take(idx)[0])
    assert torch.equal(by_latents.take(idx)[1], y[idx])
    with pytest.raises(ValueError, match="either"):
        ReplayBuffer(y, z)
