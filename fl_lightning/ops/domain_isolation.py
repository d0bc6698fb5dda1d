"""Deep Domain Isolation end to end: client features → per-class federated GMMs → linked sample clustering."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fl_lightning.ops.federated_gmm import (
    Ask,
    DiagonalGMM,
    client_answer,
    federated_em_over,
    federated_kmeans_init_over,
    gmm_payload,
    log_responsibilities,
)
from fl_lightning.ops.linking import affinity, spectral_partition
from fl_lightning.ops.per_sample_grads import class_restricted_gradients, normalise_rows


@dataclass
class ClientFeatures:
    """One client's DDI features; they never leave the client (only GMM statistics do).

    Attributes:
        features: Per class c, (N, D) normalised class-c gradients (rows of samples without c are zero).
        present: (N, C) boolean: does sample a contain class c.
    """

    features: list[Tensor]
    present: Tensor


def client_features(
    model: nn.Module,
    images: Tensor,
    masks: Tensor,
    num_classes: int,
    keep: Tensor | None = None,
    chunk_size: int = 16,
) -> ClientFeatures:
    """Class-restricted per-sample gradients, pruned to ``keep`` and L2-normalised, computed chunk by chunk.

    Chunks of ``chunk_size`` samples are pruned as soon as they are computed, so memory holds one
    chunk's full gradients, not the whole client's.

    Args:
        model: The segmentation network at the pre-trained point.
        images: (N, C_in, H, W) training images.
        masks: (N, H, W) labels.
        num_classes: C.
        keep: Parameter coordinates kept by pruned DDI (None: all).
        chunk_size: Samples per vmap chunk.

    Returns:
        The client's features and class presence.
    """
    # The statistics (EM, linking) run on the CPU in float64, whatever device the gradients come from.
    present = torch.stack([(masks == c).flatten(1).any(1) for c in range(num_classes)], dim=1).cpu()
    parts: list[Tensor] = []
    for start in range(0, len(images), chunk_size):
        grads = class_restricted_gradients(
            model, images[start : start + chunk_size], masks[start : start + chunk_size], num_classes, chunk_size
        ).detach()
        if keep is not None:  # prune on the device: only the kept coordinates travel to the CPU
            grads = grads[:, :, keep.to(grads.device)]
        parts.append(grads.cpu().double())
    grads = torch.cat(parts)
    features = [normalise_rows(grads[:, c]) * present[:, c : c + 1] for c in range(num_classes)]
    return ClientFeatures(features, present)


def client_class_answer(client: ClientFeatures, gamma: Tensor, c: int, name: str, payload: Any) -> Any:
    """A client's answer to one step of class c's federated mixture fit (its features never leave it).

    ``count``: its samples of class c. ``responsibilities``: store each class-c sample's γ under the fitted
    mixture in ``gamma`` (N, C, K), answer nothing. Any other step:
    :func:`~fl_lightning.ops.federated_gmm.client_answer`.
    """
    x = client.features[c][client.present[:, c]]
    if name == "count":
        return len(x)
    if name == "responsibilities":
        if len(x):
            gamma[client.present[:, c], c] = log_responsibilities(x, DiagonalGMM(**payload))[0].exp()
        return None
    return client_answer(x, name, payload)


def fit_classes(ask_class: Callable[[int], Ask], num_classes: int, components: int, seed: int) -> list[bool]:
    """Server side: per class, a federated diagonal GMM (k-means initialisation, EM), then the clients' γ.

    Args:
        ask_class: For class c, the round-trip to every client about its class-c features.
        num_classes: C.
        components: K, components per class.
        seed: Server seed of the k-means initialisations (seed + c for class c).

    Returns:
        Per class, whether it was fitted (classes with fewer than K samples in total are not).
    """
    fitted = []
    for c in range(num_classes):
        ask = ask_class(c)
        ok = sum(ask("count", None)) >= components
        fitted.append(ok)
        if not ok:
            continue
        init = federated_kmeans_init_over(ask, components, seed + c)
        gmm, _ = federated_em_over(ask, init)
        ask("responsibilities", gmm_payload(gmm))
    return fitted


def class_responsibilities(
    clients: Sequence[ClientFeatures], components: int, seed: int
) -> tuple[list[Tensor], list[bool]]:
    """:func:`fit_classes` over clients simulated in one process; every sample's responsibilities.

    Args:
        clients: Every client's features.
        components: K, components per class.
        seed: Server seed of the k-means initialisation.

    Returns:
        Per client, a (N_i, C, K) tensor of γ (zero where the class is absent or not fitted), and per class
        whether it was fitted.
    """
    num_classes = clients[0].present.shape[1]
    gammas = [torch.zeros(len(c.present), num_classes, components, dtype=torch.float64) for c in clients]

    def ask_class(c: int) -> Ask:
        return lambda name, payload: [client_class_answer(cl, g, c, name, payload) for cl, g in zip(clients, gammas)]

    return gammas, fit_classes(ask_class, num_classes, components, seed)


def link_clusters(
    gammas: Sequence[Tensor], present: Sequence[Tensor], fitted: Sequence[bool], n_clusters: int, seed: int
) -> list[Tensor]:
    """Server side: affinity of all samples' responsibilities, spectral clustering, one cluster id per sample.

    Args:
        gammas: Per client, (N_i, C, K) responsibilities.
        present: Per client, (N_i, C) class presence.
        fitted: Per class, whether its mixture was fitted (unfitted classes do not link).
        n_clusters: M.
        seed: Seed of the spectral clustering.

    Returns:
        Per client, the int64 cluster id (0 … M − 1) of each training sample.
    """
    all_gamma, all_present = torch.cat(list(gammas)), torch.cat(list(present))
    classes = [c for c, ok in enumerate(fitted) if ok]
    similarity = affinity([all_gamma[:, c] for c in classes], [all_present[:, c] for c in classes])
    labels = torch.as_tensor(np.asarray(spectral_partition(similarity, n_clusters, seed)), dtype=torch.int64)
    return list(labels.split([len(g) for g in gammas]))


def majority_mapping(clusters: Tensor, domains: Tensor) -> dict[int, int]:
    """Oracle routing: every true domain → the cluster holding most of its training samples."""
    out = {}
    for d in domains.unique().tolist():
        out[int(d)] = int(torch.bincount(clusters[domains == d]).argmax())
    return out
