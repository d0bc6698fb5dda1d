"""FedER: decentralised federated learning with experience replay of privacy-preserving synthetic data."""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.feder.gan import ConditionalDiscriminator, ConditionalGenerator
from callbacks.feder.generator_store import (
    GENERATORS_DIR,
    data_digest,
    fingerprint_mismatch,
    generator_path,
    load_node_gan,
    save_node_gan,
)
from callbacks.feder.perceptual import PerceptualDistance
from callbacks.feder.private_gan import DiscriminatorFactory, GeneratorFactory, PrivateGANConfig, train_node_gan
from callbacks.feder.replay import BufferBatches, ReplayBuffer, ReplayLoader, batch_sizes
from callbacks.preconditions import refuse_tables
from datamodules.sampler import stable_seed
from fl_lightning.errors import PreconditionError

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, RuntimeView, ServerView

# Fingerprint keys that must match to reuse generators from another run (`generators_from`): the same node data
# and buffer; the GAN settings may differ (e.g. the privacy audit's generators trained without L_PP).
_REUSE_KEYS = ["node", "data", "num_classes", "buffer_size"]


class ExperienceReplay(FederatedCallback):
    """FedER (Pennisi et al., 2022) and its variants FedER-A and FedER-B, on a peer-to-peer federation.

    Before round 1 every node trains a class-conditional GAN on its private data with the privacy term
    L_PP (:mod:`callbacks.feder.private_gan`) and fills its buffer with ``buffer_size`` synthetic samples; the
    generators and buffers are saved in ``<run dir>/generators/`` and loaded from there on resume (never
    retrained). Each round, every node trains on its data with each batch joined by as many samples of the
    buffer it received (none in the first round), loss CE(batch) + λ·CE(replay); then, on the round's random
    cycle, it sends its own buffer (and, in FedER, its model) to its successor.

    The join happens on the data path (:meth:`wrap_train_loader`): the node's loader yields
    ``(x, y, weights)`` batches, real samples first, and the client module weights per-sample losses.

    Messages: nodes never talk to each other. The server relays: a ``take_buffer`` query to each node (its
    own buffer: synthetic images and labels, or with ``buffer=latents`` its generator's weights, latent codes
    and labels), then ``give_buffer`` to its successor, which keeps it as its private state. In FedER the
    relay also moves the model (the Federation's ``take_private``/``put_private`` tasks); FedER-A never sends
    a model. So the relay sees synthetic data (or a generator) and, in FedER, model weights — never a real
    image (the privacy term L_PP keeps synthetic samples away from the real ones).

    Args:
        buffer_size: Synthetic samples in each node's buffer (the paper's 512).
        replay_weight: λ ≥ 0, the weight of the replay cross-entropy.
        share: ``model_and_buffer`` (FedER: model and buffer go to the successor) or ``buffer_only``
            (FedER-A: only buffers travel, each node keeps training its own model).
        train_on: ``real_and_replay`` (FedER) or ``synthetic_only`` (FedER-B: the node's own synthetic
            samples take the place of its real batches, so its model never sees a real image).
        buffer: What a buffer is: ``images`` (the generated images with labels, default) or ``latents``
            (the generator with a fixed pool of latent codes and labels; images are generated when drawn).
        gan: Settings of the GAN phase (budget, optimiser, α, LPIPS backbone); defaults as documented there.
        generator: Builds a node's generator from ``(num_classes, channels, (H, W))`` (a class_path with
            init_args in a config); default :class:`~callbacks.feder.gan.ConditionalGenerator`.
        discriminator: Builds a node's discriminator the same way; default
            :class:`~callbacks.feder.gan.ConditionalDiscriminator`.
        generators_from: A ``generators`` directory of an earlier run on the same data to reuse instead of
            training (copied into this run's directory); files must match each node's data and buffer size.

    """

    def __init__(
        self,
        buffer_size: int = 512,
        replay_weight: float = 1.0,
        share: Literal["model_and_buffer", "buffer_only"] = "model_and_buffer",
        train_on: Literal["real_and_replay", "synthetic_only"] = "real_and_replay",
        buffer: Literal["images", "latents"] = "images",
        gan: PrivateGANConfig | None = None,
        generator: GeneratorFactory = ConditionalGenerator,
        discriminator: DiscriminatorFactory = ConditionalDiscriminator,
        generators_from: str | None = None,
    ) -> None:
        super().__init__()
        choices = {"share": (share, ("model_and_buffer", "buffer_only")),
                   "train_on": (train_on, ("real_and_replay", "synthetic_only")),
                   "buffer": (buffer, ("images", "latents"))}  # fmt: skip
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"ExperienceReplay {key} must be one of {allowed}, got {value!r}")
        if buffer_size < 1 or replay_weight < 0:
            raise ValueError(
                f"ExperienceReplay needs buffer_size >= 1 and replay_weight >= 0, got {buffer_size}, {replay_weight}"
            )
        self.buffer_size, self.replay_weight = buffer_size, replay_weight
        self.share, self.train_on, self.buffer_kind = share, train_on, buffer
        self.gan = gan or PrivateGANConfig()
        self.make_generator, self.make_discriminator = generator, discriminator
        self.generators_from = generators_from
        self.buffers: dict[str, ReplayBuffer] = {}  # client half: hosted node -> its own buffer
        self._distance: PerceptualDistance | None = None  # one LPIPS module for all nodes' GAN phases

    # ------------------------------------------------------------------ both sides
    @override
    def prepare_module(self, module: L.LightningModule, data: Any) -> None:
        # The GAN phase generates images (a convolutional generator and discriminator, an LPIPS distance).
        refuse_tables(data, "callbacks.ExperienceReplay (FedER)")

    # ------------------------------------------------------------------ server half: the relay
    @override
    def on_federation_start(self, server: ServerView) -> None:
        self._check_topology(server.config.topology)

    @override
    def moves_models(self) -> bool:
        return self.share == "model_and_buffer"

    @override
    def on_pass_on(self, server: ServerView, round_idx: int, successor: dict[str, str]) -> None:
        # Every node sends its own buffer (not the one it received) to its successor, through the server.
        buffers = {node: server.query(self, "take_buffer", [node])[node] for node in successor}
        for node, succ in successor.items():
            server.query(self, "give_buffer", [succ], {"from": node, "buffer": buffers[node]})

    # ------------------------------------------------------------------ client half: the GAN phase
    @staticmethod
    def _check_topology(topology: str) -> None:
        if topology != "peer_to_peer":
            raise PreconditionError(
                f"ExperienceReplay (FedER) needs federation.topology=peer_to_peer, got {topology!r}"
            )

    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        self._check_topology(runtime.config.topology)
        if not getattr(runtime.module, "weighted_batches", False):
            raise PreconditionError(
                "ExperienceReplay needs a client module whose loss weights the replay samples (weighted_batches, "
                f"e.g. fl_lightning.clients.ClassificationClient), got {type(runtime.module).__name__}"
            )
        directory = runtime.workdir / GENERATORS_DIR
        for node in runtime.client_ids:
            if node not in runtime.data.client_ids:
                continue  # the pooled pseudo-client of centralised runs
            self.buffers[node] = self._node_buffer(runtime, node, generator_path(directory, node))

    def _node_buffer(self, runtime: RuntimeView, node: str, path: Path) -> ReplayBuffer:
        """Load the node's generator and buffer from the run (or ``generators_from``), or train and save them."""
        data = runtime.data
        split = data.client_data(node)
        expected = {
            "node": node,
            "data": data_digest(split.train_x, split.train_y),
            "num_classes": data.num_classes,
            "buffer_size": self.buffer_size,
            "gan": dataclasses.asdict(self.gan),
        }
        stored = None
        if self.generators_from is not None:
            source = generator_path(Path(self.generators_from), node)
            stored = load_node_gan(source)
            wrong = fingerprint_mismatch(stored["fingerprint"], expected, _REUSE_KEYS)
            if wrong:
                raise ValueError(f"ExperienceReplay.generators_from: {source} does not fit node {node!r}: {wrong}")
            if source.resolve() != path.resolve():
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, path)  # the run directory holds what the run used (resume, audit)
        elif path.is_file():
            stored = load_node_gan(path)
            wrong = fingerprint_mismatch(stored["fingerprint"], expected)
            if wrong:
                warnings.warn(
                    f"{path} was made for other settings ({wrong}); training node {node!r} again", stacklevel=2
                )
                stored = None
        if stored is None:
            stored = self._train_node(runtime, node, expected)
            save_node_gan(path, **stored)
        payload = {"labels": stored["labels"], "latents": stored["latents"]}
        if self.buffer_kind == "latents":
            payload["generator"] = stored["generator"]
        else:
            payload["images"] = stored["images"]
        return self._buffer(payload, data)

    def _buffer(self, payload: dict[str, Any], data: Any) -> ReplayBuffer:
        """A buffer from its plain form (what travels): images, or the generator's weights with the codes."""
        generator = None
        if "generator" in payload:
            generator = self.make_generator(data.num_classes, data.in_channels, tuple(data.image_size))
            generator.load_state_dict(payload["generator"])
            generator.eval()
        return ReplayBuffer(payload["labels"], payload["latents"], images=payload.get("images"), generator=generator)

    def _train_node(self, runtime: RuntimeView, node: str, fingerprint: dict[str, Any]) -> dict[str, Any]:
        split = runtime.data.client_data(node)
        runtime.note(
            f"FedER: training the private GAN of node {node!r} ({self.gan.num_steps(len(split.train_y))} steps)"
        )
        if self.gan.privacy_weight and self._distance is None:
            self._distance = self.gan.build_distance()
        stored = train_node_gan(
            node, split.train_x, split.train_y, runtime.data.num_classes, self.gan, self.buffer_size,
            distance=self._distance, make_generator=self.make_generator, make_discriminator=self.make_discriminator,
            device=runtime.device,
        )  # fmt: skip
        return {**stored, "fingerprint": fingerprint}

    # ------------------------------------------------------------------ client half: rounds
    @override
    def answer_query(self, ctx: ClientContext, name: str, payload: Any) -> Any:
        if name == "take_buffer":
            own = self.buffers[ctx.client_id]
            out: dict[str, Tensor] = {"labels": own.labels, "latents": own.latents}
            if own.generator is not None:
                out["generator"] = own.generator.state_dict()
            else:
                out["images"] = own.images
            return out
        if name == "give_buffer":
            ctx.state["received"] = payload  # {"from": node, "buffer": its plain buffer}
            return None
        return super().answer_query(ctx, name, payload)

    @override
    def wrap_train_loader(self, ctx: ClientContext, loader: DataLoader) -> Any:
        received = ctx.state.get("received")
        replay = self._buffer(received["buffer"], ctx.data) if received is not None else None
        seed, client_id, round_idx = ctx.seed, ctx.client_id, ctx.round
        if self.train_on == "synthetic_only":
            # FedER-B: the real loader is only read for its batch sizes; its images never reach the model.
            own = BufferBatches(
                self.buffers[client_id], batch_sizes(loader), stable_seed(seed, "own", client_id, round_idx)
            )
            return ReplayLoader(own, replay, self.replay_weight, stable_seed(seed, "replay", client_id, round_idx))
        if replay is None:
            return loader
        return ReplayLoader(loader, replay, self.replay_weight, stable_seed(seed, "replay", client_id, round_idx))
