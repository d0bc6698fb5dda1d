"""FedER, FedER-A and FedER-B end to end on tiny digits: what travels, what each node trains on, exact resume."""

from collections import defaultdict
from functools import partial

import pytest
import torch

from callbacks import ExperienceReplay, FederatedCallback
from callbacks.feder.gan import ConditionalDiscriminator, ConditionalGenerator
from callbacks.feder.generator_store import load_node_gan
from callbacks.feder.private_gan import PrivateGANConfig
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import clone_state
from fl_lightning.server.selection import random_cycle
from tests.conftest import build_federation, tiny_data

GAN = PrivateGANConfig(epochs=2, batch_size=8, privacy_pairs=4)  # 8 steps per node on 32 images
P2P = {"topology": "peer_to_peer"}


def replay(**kwargs):
    args = {
        "buffer_size": 16,
        "gan": GAN,
        "generator": partial(ConditionalGenerator, latent_dim=4, width=4),
        "discriminator": partial(ConditionalDiscriminator, width=4),
    }
    return ExperienceReplay(**{**args, **kwargs})


@pytest.fixture(scope="module")
def generators(tmp_path_factory):
    """Generators trained once (the GAN phase of a 1-round run), reused by the tests through generators_from."""
    out = tmp_path_factory.mktemp("gan")
    build_federation(out, [replay()], rounds=1, run_name="g", **P2P).run()
    return out / "g" / "generators"


class Recorder(FederatedCallback):
    """Per (round, node): the start state, the upload, every training batch and every input the network saw."""

    def __init__(self):
        self.round, self.node = None, None
        self.starts, self.uploads = {}, {}
        self.batches, self.inputs = defaultdict(list), defaultdict(list)

    def on_federation_start(self, federation):
        net = federation.module.net
        net.register_forward_pre_hook(lambda mod, args: self.inputs[(self.round, self.node)].append(args[0].clone())
                                      if mod.training else None)  # fmt: skip

    def on_round_start(self, federation, round_idx, selected):
        self.round = round_idx

    def on_client_start(self, ctx, module):
        client_id = ctx.client_id
        self.node = client_id
        self.starts[(self.round, client_id)] = clone_state(module.state_dict())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches[(self.round, self.node)].append([t.clone() for t in batch])

    def on_client_end(self, ctx, module, update):
        client_id = ctx.client_id
        self.uploads[(self.round, client_id)] = clone_state(update.state)


def rows_in(x, pool, atol=0.0):
    """Whether each image of x is (to atol) one of pool's images."""
    diff = (x.flatten(1)[:, None, :] - pool.flatten(1)[None, :, :]).abs().amax(dim=2)
    return (diff <= atol).any(dim=1)


def predecessors(ids, r):
    return {succ: node for node, succ in random_cycle(ids, r, seed=0).items()}


def equal_states(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_feder_joins_real_batches_with_the_predecessors_buffer_and_passes_models_on(tmp_path, generators):
    rounds, lam = 3, 0.7
    er, rec = replay(generators_from=str(generators), replay_weight=lam), Recorder()
    fed = build_federation(tmp_path, [er, rec], rounds=rounds, **P2P)
    fed.run()
    ids = fed.data.client_ids
    assert (tmp_path / fed.run_dir.path.name / "generators" / "site0.pt").read_bytes() == (
        generators / "site0.pt"
    ).read_bytes()  # the run directory holds the generators it used
    for node in ids:
        assert all(len(b) == 2 for b in rec.batches[(0, node)])  # round 1: no buffer received yet
    for r in range(1, rounds):
        pred = predecessors(ids, r - 1)
        for node in ids:
            real = fed.data.client_data(node).train_x
            buffer = er.buffers[pred[node]]
            assert equal_states(rec.starts[(r, node)], rec.uploads[(r - 1, pred[node])])  # the model travelled
            for x, y, w in rec.batches[(r, node)]:
                b = len(y) // 2
                assert len(y) == 2 * b and rows_in(x[:b], real).all()
                # the other half: samples of the predecessor's own buffer, with their labels
                assert rows_in(x[b:], buffer.images).all() and not rows_in(x[b:], real).any()
                idx = [int(rows_in(buffer.images, xi[None]).nonzero()[0]) for xi in x[b:]]
                assert torch.equal(y[b:], buffer.labels[idx])
                torch.testing.assert_close(w, torch.tensor([1 / b] * b + [lam / b] * b))
    last = predecessors(ids, rounds - 1)
    held = {
        node: states[er.state_key]["received"]["from"] for node, states in fed.transport.runtime.callback_states.items()
    }
    assert held == last  # after the last round each node holds its predecessor's buffer...
    for node in ids:  # ...and its predecessor's model
        assert equal_states(fed.transport.private[("global", node)], rec.uploads[(rounds - 1, last[node])])


def test_feder_a_keeps_models_home_while_latent_buffers_travel(tmp_path, generators):
    rounds = 3
    er, rec = replay(generators_from=str(generators), share="buffer_only", buffer="latents"), Recorder()
    fed = build_federation(tmp_path, [er, rec], rounds=rounds, **P2P)
    fed.run()
    ids = fed.data.client_ids
    assert not er.moves_models() and er.buffers["site0"].generator is not None
    for r in range(1, rounds):
        pred = predecessors(ids, r - 1)
        for node in ids:
            assert equal_states(rec.starts[(r, node)], rec.uploads[(r - 1, node)])  # never left its node
            stored = load_node_gan(generators / f"{pred[node]}.pt")["images"]
            for x, y, _ in rec.batches[(r, node)]:
                assert rows_in(x[len(y) // 2 :], stored, atol=1e-5).all()  # generated on the fly = the pool's images
    for node in ids:
        assert equal_states(fed.transport.private[("global", node)], rec.uploads[(rounds - 1, node)])


def test_feder_b_never_shows_the_classifier_a_real_image_yet_trains(tmp_path, generators):
    rounds = 2
    er, rec = replay(generators_from=str(generators), train_on="synthetic_only"), Recorder()
    fed = build_federation(tmp_path, [er, rec], rounds=rounds, **P2P)
    fed.run()
    ids = fed.data.client_ids
    all_real = torch.cat([fed.data.client_data(c).train_x for c in ids])
    for r in range(rounds):
        pred = predecessors(ids, r - 1) if r else {}
        for node in ids:
            seen = torch.cat(rec.inputs[(r, node)])
            assert len(seen) == sum(len(b[1]) for b in rec.batches[(r, node)]) > 0
            assert not rows_in(seen, all_real).any()
            allowed = er.buffers[node].images
            if r:
                allowed = torch.cat([allowed, er.buffers[pred[node]].images])
            assert rows_in(seen, allowed).all()
            assert not equal_states(rec.uploads[(r, node)], rec.starts[(r, node)])  # it still trains
    # as many batches as the real loader would give, the same size, doubled by the replay from round 2 on
    sizes = [len(b[1]) for b in fed.data.client_train_loader("site0")]
    assert [len(b[1]) for b in rec.batches[(0, "site0")]] == sizes
    assert [len(b[1]) for b in rec.batches[(1, "site0")]] == [2 * s for s in sizes]


def test_resume_mid_federation_is_exact_without_training_the_gans_again(tmp_path, monkeypatch):
    full = build_federation(tmp_path, [replay()], rounds=3, run_name="full", **P2P)
    full_summary = full.run()
    build_federation(tmp_path, [replay()], rounds=2, run_name="part", **P2P).run()
    saved = {p.name: p.read_bytes() for p in (tmp_path / "part" / "generators").iterdir()}
    assert saved == {p.name: p.read_bytes() for p in (tmp_path / "full" / "generators").iterdir()}  # seeded GANs

    def no_training(*args, **kwargs):
        raise AssertionError("the GANs were trained again on resume")

    monkeypatch.setattr("callbacks.feder.experience_replay.train_node_gan", no_training)
    resumed = build_federation(tmp_path, [replay()], rounds=3, run_name="part", resume="last", **P2P)
    summary = resumed.run()
    assert saved == {p.name: p.read_bytes() for p in (tmp_path / "part" / "generators").iterdir()}
    for node in resumed.data.client_ids:
        assert equal_states(resumed.transport.private[("global", node)], full.transport.private[("global", node)])
    strip = lambda s: {k: v for k, v in s.items() if k != "run_dir"}  # noqa: E731
    assert strip(summary) == strip(full_summary)


def test_misuse_fails_clearly(tmp_path, generators):
    with pytest.raises(PreconditionError, match="topology=peer_to_peer"):
        build_federation(tmp_path, [replay(generators_from=str(generators))]).run()
    other_data = tiny_data(seed=1)
    with pytest.raises(ValueError, match="node 'site0'.*data"):
        build_federation(tmp_path, [replay(generators_from=str(generators))], data=other_data, **P2P).run()
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_federation(tmp_path, [replay(generators_from=str(tmp_path / "nowhere"))], **P2P).run()
    for bad in ({"share": "model"}, {"train_on": "real"}, {"buffer": "codes"}, {"buffer_size": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ExperienceReplay(**bad)
    with pytest.raises(ValueError, match="gan.privacy_weight=-1"):
        PrivateGANConfig(privacy_weight=-1)


def test_generators_left_by_other_settings_are_trained_again(tmp_path, generators):
    # A run directory is never reused by a new run, so stale generators can only meet a resume: a first round
    # copies generators of this data with buffer size 16 into r/generators, the resume asks for 8.
    build_federation(tmp_path, [replay(generators_from=str(generators))], rounds=1, run_name="r", **P2P).run()
    run = tmp_path / "r" / "generators"
    er = replay(buffer_size=8)
    with pytest.warns(UserWarning, match="buffer_size: 16 != 8"):
        build_federation(tmp_path, [er], rounds=2, run_name="r", resume="last", **P2P).run()
    assert len(er.buffers["site0"]) == 8 and len(load_node_gan(run / "site0.pt")["labels"]) == 8
