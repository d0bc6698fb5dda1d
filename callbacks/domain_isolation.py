"""Deep Domain Isolation + sample-clustered FL (Manthe, Lartizien, Duffner, 2024)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from sklearn.metrics import adjusted_rand_score, rand_score
from torch import Tensor, nn
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.cluster_selector import predict_clusters, train_selector
from fl_lightning.ops.domain_isolation import class_responsibilities, client_features, link_clusters, majority_mapping
from fl_lightning.ops.per_sample_grads import prune_indices

if TYPE_CHECKING:
    from fl_lightning.federation import Federation


class DomainIsolation(FederatedCallback):
    """DDI sample clustering at ``split_round``, then one model per cluster and a federated cluster selector.

    At the end of round ``split_round`` (1-based) every client computes, at the current global model,
    each training sample's class-restricted gradients (``torch.func``, chunked), optionally pruned to
    a seeded random ``prune_fraction`` of the coordinates (the same on every client) and L2-normalised.
    Per class a diagonal GMM with ``components_per_class`` components is fitted by federated EM; the
    server links the responsibilities (affinity + spectral clustering) into ``n_clusters`` clusters,
    one per sample. The group is then split into sample-level groups (sample-clustered FedAvg, weights
    n_{i,m}/n_m, all from the split-round model) and a small CNN cluster selector is trained
    federatedly with SCAFFOLD (lr 0.005, weight decay 1e-3) on (image, cluster id).

    Evaluation adds ``selector`` (each test image to the model of its predicted cluster) and, when the
    data know each image's domain, ``oracle`` (to the cluster holding most training samples of its
    domain). With a known domain the Rand index and adjusted Rand index of the clustering go to
    ``rounds.csv`` (``ddi/rand_index``, ``ddi/adjusted_rand_index``) and ``summary.json``
    (``domain_isolation``); the gradients' 2-D PCA scatter goes to ``ddi_gradients.png``.

    With ``split_round`` beyond the last round nothing is split (plain FedAvg).

    Args:
        split_round: Cluster at the end of this round (1-based).
        n_clusters: M, the number of sample clusters (models).
        components_per_class: K, mixture components per class.
        prune_fraction: Fraction of gradient coordinates kept (pruned DDI), or None for all.
        chunk_size: Samples per vmap chunk of the per-sample gradients.
        seed: Server seed (pruned coordinates, k-means initialisation, spectral clustering, selector).
        selector_rounds: Federated rounds of the selector's training.
        selector_local_steps: Local SGD steps per selector round.
        selector_lr: Selector learning rate (plain SGD, as SCAFFOLD needs).
        selector_weight_decay: Selector weight decay.
        selector_width: Channels of the selector CNN.
        plots: Write the gradient scatter PNG.
    """

    def __init__(
        self,
        split_round: int,
        n_clusters: int = 2,
        components_per_class: int = 2,
        prune_fraction: float | None = None,
        chunk_size: int = 16,
        seed: int = 0,
        selector_rounds: int = 20,
        selector_local_steps: int = 5,
        selector_lr: float = 0.005,
        selector_weight_decay: float = 1e-3,
        selector_width: int = 8,
        plots: bool = True,
    ) -> None:
        super().__init__()
        if split_round < 1 or n_clusters < 2 or components_per_class < 1:
            raise ValueError("DomainIsolation needs split_round >= 1, n_clusters >= 2, components_per_class >= 1")
        self.split_round, self.n_clusters, self.components = split_round, n_clusters, components_per_class
        self.prune_fraction, self.chunk_size, self.seed = prune_fraction, chunk_size, seed
        self.selector_args = {
            "rounds": selector_rounds,
            "local_steps": selector_local_steps,
            "lr": selector_lr,
            "weight_decay": selector_weight_decay,
            "width": selector_width,
        }
        self.plots = plots
        self.clusters: dict[str, Tensor] | None = None  # per client, the cluster id of each training sample
        self.group_names: dict[int, str] = {}  # cluster id -> model group
        self.oracle: dict[int, int] = {}  # true domain -> cluster
        self.scores: dict[str, float] = {}
        self.selector: nn.Module | None = None
        self._selector_state: dict[str, Tensor] | None = None

    @override
    def on_federation_start(self, federation: Federation) -> None:
        module = federation.module
        if not hasattr(module, "net") or not hasattr(module, "input_norm"):
            raise ValueError("DomainIsolation needs a client module with `net` and `input_norm` (SegmentationClient)")
        if federation.config.mode != "federated" or federation.config.topology != "star":
            raise ValueError("DomainIsolation needs federated star training")

    # ------------------------------------------------------------------ the split
    @override
    def on_round_end(self, federation: Federation, round_idx: int, metrics: dict[str, Any]) -> None:
        if round_idx + 1 != self.split_round or self.clusters is not None:
            return
        group = federation.groups[0]
        data, ids = federation.data, list(federation.data.client_ids)
        model = _full_model(federation.module, group.state).to(federation.device)
        num_classes = int(federation.module.hparams.num_classes)
        keep = None
        if self.prune_fraction is not None:
            num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
            keep = prune_indices(num_params, self.prune_fraction, self.seed)  # the server sends only the seed
        feats = []
        for cid in ids:  # on each client
            split = data.client_data(cid)
            x, y = split.train_x.to(federation.device), split.train_y.to(federation.device)
            feats.append(client_features(model, x, y, num_classes, keep, self.chunk_size))
        gammas, fitted = class_responsibilities(feats, self.components, self.seed)
        labels = link_clusters(gammas, [f.present for f in feats], fitted, self.n_clusters, self.seed)
        self.clusters = dict(zip(ids, labels))
        children = federation.split_samples(group, self.clusters, self.n_clusters)
        self.group_names = {int(c.name.rsplit(".", 1)[1]): c.name for c in children}
        domains = [data.client_data(c).train_domain for c in ids]
        if all(d is not None for d in domains):
            truth, pred = torch.cat(domains), torch.cat(labels)
            self.oracle = majority_mapping(pred, truth)
            self.scores = {
                "rand_index": float(rand_score(truth.numpy(), pred.numpy())),
                "adjusted_rand_index": float(adjusted_rand_score(truth.numpy(), pred.numpy())),
            }
            metrics.update({f"ddi/{k}": v for k, v in self.scores.items()})
        if self.plots and federation.run_dir is not None:
            from fl_lightning.ddi_plots import plot_gradient_scatter  # matplotlib only when plotting

            plot_gradient_scatter(feats, labels, domains, federation.run_dir.path / "ddi_gradients.png")
        self.selector = train_selector(
            federation, self.clusters, self.oracle, self.n_clusters, self.seed, **self.selector_args
        )

    # ------------------------------------------------------------------ routed evaluation
    @override
    def extra_evaluation(self, federation: Federation) -> dict[str, dict[str, dict[str, float]]]:
        if self.clusters is None:
            return {}
        if self.selector is None:  # resumed: rebuild the selector from its saved weights
            from fl_lightning.cluster_selector import build_selector

            self.selector = build_selector(federation, self.n_clusters, self.selector_args["width"])
            self.selector.load_state_dict(self._selector_state)
        out: dict[str, dict[str, dict[str, float]]] = {"selector": {}}
        if self.oracle:
            out["oracle"] = {}
        for cid in federation.data.client_ids:
            split = federation.data.client_data(cid)
            if not len(split.test_y):
                continue
            routes = {"selector": predict_clusters(self.selector, split.test_x, federation.device)}
            if self.oracle:
                # a domain never seen in training goes to cluster 0
                routes["oracle"] = torch.tensor([self.oracle.get(int(d), 0) for d in split.test_domain])
            for name, route in routes.items():
                out[name][cid] = self.routed_metrics(federation, cid, route)
        return out

    def routed_metrics(self, federation: Federation, client_id: str, routes: Tensor) -> dict[str, float]:
        """The client module's evaluation of ``client_id``'s test set with test image j sent to model ``routes[j]``."""
        module = federation.module
        groups = {g.name: g for g in federation.groups}
        fallback = next(iter(self.group_names.values()))
        models = [_full_model(module, groups[self.group_names.get(m, fallback)].state) for m in range(self.n_clusters)]
        net, norm = module.net, module.input_norm
        module.net, module.input_norm = _RoutedNet(models, routes), nn.Identity()
        try:
            return module.evaluate(federation.data.client_test_loader(client_id), federation.device)
        finally:
            module.net, module.input_norm = net, norm

    # ------------------------------------------------------------------ reporting and checkpoints
    @override
    def summary_entries(self, federation: Federation) -> dict[str, Any]:
        if self.clusters is None:
            return {"domain_isolation": {"split": False}}
        sizes = [int(sum(int((c == m).sum()) for c in self.clusters.values())) for m in range(self.n_clusters)]
        return {"domain_isolation": {"split": True, "cluster_sizes": sizes, "oracle": self.oracle, **self.scores}}

    @override
    def state_dict(self) -> dict[str, Any]:
        selector = self.selector.state_dict() if self.selector is not None else self._selector_state
        return {
            "clusters": self.clusters,
            "group_names": self.group_names,
            "oracle": self.oracle,
            "scores": self.scores,
            "selector": selector,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.clusters = state_dict["clusters"]
        self.group_names = {int(k): v for k, v in state_dict["group_names"].items()}
        self.oracle = {int(k): int(v) for k, v in state_dict["oracle"].items()}
        self.scores = dict(state_dict["scores"])
        self._selector_state, self.selector = state_dict["selector"], None


def _full_model(module: nn.Module, state: dict[str, Tensor]) -> nn.Sequential:
    """A standalone copy of ``input_norm`` → ``net`` of the client module, loaded with a group's state."""
    norm, net = copy.deepcopy(module.input_norm), copy.deepcopy(module.net)
    norm.load_state_dict({k[len("input_norm.") :]: v for k, v in state.items() if k.startswith("input_norm.")})
    net.load_state_dict({k[len("net.") :]: v for k, v in state.items() if k.startswith("net.")})
    return nn.Sequential(norm, net)


class _RoutedNet(nn.Module):
    """Sends the j-th image it sees to ``models[routes[j]]`` (the test loader is unshuffled, so j is its index)."""

    def __init__(self, models: list[nn.Module], routes: Tensor) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)
        self.routes, self.cursor = routes, 0

    def forward(self, x: Tensor) -> Tensor:
        route = self.routes[self.cursor : self.cursor + len(x)].to(x.device)
        self.cursor += len(x)
        outputs = {int(m): self.models[int(m)].to(x.device)(x[route == m]) for m in route.unique()}
        first = next(iter(outputs.values()))
        out = first.new_empty((len(x), *first.shape[1:]))
        for m, y in outputs.items():
            out[route == m] = y
        return out
