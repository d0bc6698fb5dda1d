"""The privacy audit: finds memorised images, and writes the histogram and numbers for a FedER run."""

import json

import pytest
import torch
from torch import nn

from callbacks.feder.perceptual import PerceptualDistance
from callbacks.feder.privacy_audit import audit_node
from callbacks.feder.privacy_audit import main as audit_main
from fl_lightning.cli import main as train_main


class Memoriser(nn.Module):
    """A 'generator' that returns training images: the failure the audit must detect."""

    latent_dim = 1

    def __init__(self, images):
        super().__init__()
        self.register_buffer("images", images)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, z, y):
        return self.images[(z[:, 0].abs() * 1000).long() % len(self.images)] * self.scale


class Blank(Memoriser):
    def forward(self, z, y):
        return torch.full_like(self.images[: len(z)], 0.5) * self.scale + 0 * z.sum()


def test_a_memorising_generator_is_caught_and_a_blank_one_is_not():
    torch.manual_seed(0)
    real, labels = torch.rand(6, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    distance = PerceptualDistance()
    found = audit_node(distance, Memoriser(real), real, labels, samples=300, latent_steps=2, seed=0)
    assert found["sample"].max() < 1e-5 and found["latent"].max() < 1e-5
    far = audit_node(distance, Blank(real.repeat(50, 1, 1, 1)), real, labels, samples=300, latent_steps=2, seed=0)
    assert far["sample"].min() > 1e-3 and (far["latent"] <= far["sample"]).all()


def test_the_command_writes_histograms_with_and_without_the_privacy_term(tmp_path):
    train_main([
        "--config", "configs/feder_digits.yaml", "--trainer.logger=false", "--federation.rounds=1",
        "--federation.progress=false", "--federation.plots=false", "--data.max_samples_per_client=20",
        "--data.image_size=8", "--data.num_clients=2", "--model.width=4", f"--federation.output_dir={tmp_path}",
        "--federation.run_name=r",
    ])  # fmt: skip
    run = tmp_path / "r"
    results = audit_main(["--run", str(run), "--samples", "32", "--latent-steps", "1"])
    assert (run / "privacy_audit.png").stat().st_size > 0
    assert json.loads((run / "privacy_audit.json").read_text()) == json.loads(json.dumps(results))
    assert sorted((run / "generators_no_privacy").iterdir()) != []  # the α = 0 reference, trained once, kept
    sets = results["sets"]
    assert set(sets) == {"with L_PP (alpha = 10)", "without L_PP (alpha = 0)"}  # the config's alpha
    n = results["real_to_real"]["n"]
    assert n == 2 * 16  # every real training image of every node (20 samples, 4 held out for test)
    for entry in sets.values():
        for search in ("sample", "latent"):
            assert entry[search]["n"] == n and sum(entry[search]["histogram"]) == n
            assert 0 <= entry[search]["min"] <= entry[search]["median"]
        assert entry["latent"]["median"] <= entry["sample"]["median"]
    assert results["lpips"] == {"net": "alex", "pretrained_backbone": False}
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        audit_main(["--run", str(tmp_path)])
