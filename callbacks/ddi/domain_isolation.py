"""Deep Domain Isolation + sample-clustered FL (Manthe, Lartizien, Duffner, 2024)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from sklearn.metrics import adjusted_rand_score, rand_score
from torch import Tensor, nn
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.ddi.cluster_selector import (
    QUERY,
    SelectorRuntime,
    build_selector,
    predict_clusters,
    selector_runtime,
    selector_splits,
    train_selector,
)
from callbacks.preconditions import refuse_tables
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.domain_isolation import (
    ClientFeatures,
    client_class_answer,
    client_features,
    fit_classes,
    link_clusters,
)
from fl_lightning.ops.per_sample_grads import prune_indices
from fl_lightning.server.directory import ClientDirectory

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, RuntimeView, ServerView


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

    Messages (query tasks; the clients' per-sample gradients never leave them): ``features`` (the global
    state goes out; each client computes and keeps its features, answers its class counts), per class
    ``count``/``moments``/``kmeans``/``hard_stats``/``estep`` (k-means and EM sufficient statistics) and
    ``responsibilities``, then ``gammas`` (each sample's responsibilities γ, which the server's spectral
    linking needs: like the paper's server, ours sees γ per sample, not the gradients), ``assign`` (each
    client gets its own samples' cluster ids), ``contingency`` (cluster × domain counts, for the oracle and
    the Rand index), the selector's tasks inside ``selector`` queries, and ``routed`` (evaluation with every
    cluster model and the selector). The gradient scatter plot is the exception: with ``plots`` the
    ``features`` answer carries the (pruned) gradients to the server, a simulation diagnostic; set
    ``plots: false`` in a deployment.

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

    # Each runtime's clients' features, responsibilities and routing stay in this object between queries.
    runtime_bound = True

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
        self._eval_token = 0

    # ------------------------------------------------------------------ both sides
    @override
    def prepare_module(self, module: L.LightningModule, data: Any) -> None:
        # The cluster selector is a small CNN on (image, cluster id).
        refuse_tables(data, "callbacks.DomainIsolation")

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        if server.config.mode != "federated" or server.config.topology != "star":
            raise ValueError("DomainIsolation needs federated star training")

    @override
    def on_round_end(self, server: ServerView, round_idx: int, metrics: dict[str, Any]) -> None:
        if round_idx + 1 != self.split_round or self.clusters is not None:
            return
        group = server.groups[0]
        ids = list(server.data.client_ids)

        def ask(name: str, payload: Any, **kwargs: Any) -> list[Any]:
            return list(server.query(self, name, ids, payload, **kwargs).values())

        request = {"prune_fraction": self.prune_fraction, "seed": self.seed, "chunk_size": self.chunk_size,
                   "plots": self.plots and server.run_path is not None}  # fmt: skip
        answers = ask("features", request, group=group.name, state=group.state)
        num_classes = int(server.module.hparams.num_classes)
        fitted = fit_classes(
            lambda c: lambda step, payload: ask(step, {"c": c, "step": payload}),
            num_classes,
            self.components,
            self.seed,
        )
        gammas = ask("gammas", None)
        labels = link_clusters(
            [g["gamma"] for g in gammas], [g["present"] for g in gammas], fitted, self.n_clusters, self.seed
        )
        self.clusters = dict(zip(ids, labels))
        server.query(self, "assign", ids, self.clusters, per_client=True)
        children = server.split_samples(group, self.clusters, self.n_clusters)
        self.group_names = {int(c.name.rsplit(".", 1)[1]): c.name for c in children}
        contingency = ask("contingency", None)
        if all(c is not None for c in contingency):
            self.oracle, self.scores = oracle_and_scores(contingency, self.n_clusters)
            metrics.update({f"ddi/{k}": v for k, v in self.scores.items()})
        if request["plots"]:
            from callbacks.ddi.plots import plot_gradient_scatter  # matplotlib only when plotting

            feats = [ClientFeatures(a["features"], a["present"]) for a in answers]
            domains = [a["domain"] for a in answers]
            plot_gradient_scatter(feats, labels, domains, server.run_path / "ddi_gradients.png")
        sizes = ask("sizes", bool(self.oracle))
        directory = ClientDirectory(
            {c: len(self.clusters[c]) for c in ids}, {c: s for c, s in zip(ids, sizes)}, server.data.batch_size,
            self.seed,
        )  # fmt: skip
        image_shape = (server.data.in_channels, server.data.image_size)
        self.selector = train_selector(server, self, directory, image_shape, self._selector_settings(server))
        ask("selector_done", None)

    def _selector_settings(self, server: ServerView) -> dict[str, Any]:
        return {**self.selector_args, "n_clusters": self.n_clusters, "seed": self.seed, "oracle": self.oracle,
                "batch_size": server.data.batch_size}  # fmt: skip

    # ------------------------------------------------------------------ routed evaluation
    @override
    def extra_evaluation(self, server: ServerView) -> dict[str, dict[str, dict[str, float]]]:
        if self.clusters is None:
            return {}
        if self.selector is None:  # resumed: rebuild the selector from its saved weights
            self.selector = build_selector(
                server.data.in_channels, server.data.image_size, self.n_clusters, self.selector_args["width"]
            )
            self.selector.load_state_dict(self._selector_state)
        groups = {g.name: g for g in server.groups}
        fallback = next(iter(self.group_names.values()))
        self._eval_token += 1  # clients build the models once per evaluation, not once per client
        payload = {
            "token": self._eval_token,
            "models": [groups[self.group_names.get(m, fallback)].state for m in range(self.n_clusters)],
            "selector": self.selector.state_dict(),
            "oracle": self.oracle,
            "width": self.selector_args["width"],
            "split": server.eval_split,  # val on evaluation rounds with a validation split; test at the end
        }
        answers = server.query(self, "routed", list(server.data.client_ids), payload)
        out: dict[str, dict[str, dict[str, float]]] = {"selector": {}}
        if self.oracle:
            out["oracle"] = {}
        for cid, routed in answers.items():
            for name, metrics in (routed or {}).items():
                out[name][cid] = metrics
        return out

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        module = runtime.module
        if not hasattr(module, "net") or not hasattr(module, "input_norm"):
            raise PreconditionError(
                "DomainIsolation needs a client module with `net` and `input_norm` (SegmentationClient)"
            )
        self._features: dict[str, ClientFeatures] = {}
        self._gammas: dict[str, Tensor] = {}
        self._selector_runtime: SelectorRuntime | None = None
        self._routing: tuple[int, list[nn.Module], nn.Module] | None = None

    @override
    def answer_query(self, ctx: ClientContext, name: str, payload: Any) -> Any:
        cid = ctx.client_id
        split = ctx.data.client_data(cid) if name in ("features", "contingency", "sizes") else None
        if name == "features":
            model = _full_model(ctx.module, ctx.received).to(ctx.device)
            keep = None
            if payload["prune_fraction"] is not None:  # the server sends only the fraction and the seed
                num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
                keep = prune_indices(num_params, payload["prune_fraction"], payload["seed"])
            x, y = split.train_x.to(ctx.device), split.train_y.to(ctx.device)
            num_classes = int(ctx.module.hparams.num_classes)
            feats = client_features(model, x, y, num_classes, keep, payload["chunk_size"])
            self._features[cid] = feats
            self._gammas[cid] = torch.zeros(len(feats.present), num_classes, self.components, dtype=torch.float64)
            if payload["plots"]:
                return {"features": feats.features, "present": feats.present, "domain": split.train_domain}
            return None
        if name == "gammas":
            return {"gamma": self._gammas[cid], "present": self._features[cid].present}
        if name == "assign":
            ctx.state["clusters"] = payload  # this client's samples' cluster ids stay with it
            self._features.pop(cid, None)
            self._gammas.pop(cid, None)
            return None
        if name == "contingency":
            if split.train_domain is None:
                return None
            return torch.stack([ctx.state["clusters"], split.train_domain.to(torch.int64)], 1)
        if name == "sizes":  # of the selector's test set: test images with oracle labels, else training images
            return len(split.test_y) if payload and split.test_domain is not None else len(split.train_y)
        if name == QUERY:
            return self._selector(ctx, payload)
        if name == "selector_done":
            self._selector_runtime = None
            return None
        if name == "routed":
            return self._routed(ctx, payload)
        if isinstance(payload, dict) and "c" in payload:  # a step of class c's federated mixture fit
            return client_class_answer(self._features[cid], self._gammas[cid], payload["c"], name, payload["step"])
        return super().answer_query(ctx, name, payload)

    def _selector(self, ctx: ClientContext, payload: dict[str, Any]) -> Any:
        """A task of the selector's federation, answered by this side's selector runtime (built on first use)."""
        if self._selector_runtime is None:
            hosted = {
                cid: (ctx.data.client_data(cid), state["clusters"])
                for cid, state in ctx.hosted_states().items()
                if "clusters" in state
            }
            oracle = {int(k): int(v) for k, v in payload["settings"]["oracle"].items()}
            splits = selector_splits(hosted, oracle)
            self._selector_runtime = selector_runtime(splits, payload["settings"], ctx.device)
        return self._selector_runtime.handle(payload["task"])

    def _routed(self, ctx: ClientContext, payload: dict[str, Any]) -> dict[str, dict[str, float]] | None:
        """Client side of the routed evaluation: each test/val image to the model of its predicted or oracle cluster."""
        cid, which = ctx.client_id, str(payload.get("split", "test"))
        split = ctx.data.client_data(cid)
        images, domains = (split.val_x, split.val_domain) if which == "val" else (split.test_x, split.test_domain)
        if images is None or not len(images):
            return None
        if self._routing is None or self._routing[0] != payload["token"]:
            models = [_full_model(ctx.module, state) for state in payload["models"]]
            selector = build_selector(ctx.data.in_channels, ctx.data.image_size, len(models), int(payload["width"]))
            selector.load_state_dict(payload["selector"])
            self._routing = (payload["token"], models, selector)
        _, models, selector = self._routing
        routes = {"selector": predict_clusters(selector, images, ctx.device)}
        oracle = {int(k): int(v) for k, v in payload["oracle"].items()}
        if oracle:
            # a domain never seen in training goes to cluster 0
            routes["oracle"] = torch.tensor([oracle.get(int(d), 0) for d in domains])
        return {name: routed_metrics(ctx, cid, models, route, which) for name, route in routes.items()}

    # ------------------------------------------------------------------ reporting and checkpoints
    @override
    def summary_entries(self, server: ServerView) -> dict[str, Any]:
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


def oracle_and_scores(pairs: list[Tensor], n_clusters: int) -> tuple[dict[int, int], dict[str, float]]:
    """Oracle routing and the clustering's Rand indices from the clients' (cluster, domain) pairs.

    Args:
        pairs: Per client, (N_i, 2) int64 rows of (cluster id, true domain) of its training samples.
        n_clusters: M.

    Returns:
        True domain → the cluster holding most of its training samples, and the Rand and adjusted Rand index.
    """
    both = torch.cat(pairs)
    pred, truth = both[:, 0], both[:, 1]
    oracle = {}
    for d in truth.unique().tolist():
        oracle[int(d)] = int(torch.bincount(pred[truth == d], minlength=n_clusters).argmax())
    scores = {
        "rand_index": float(rand_score(truth.numpy(), pred.numpy())),
        "adjusted_rand_index": float(adjusted_rand_score(truth.numpy(), pred.numpy())),
    }
    return oracle, scores


def routed_metrics(
    ctx: ClientContext, client_id: str, models: list[nn.Module], routes: Tensor, split: str = "test"
) -> dict[str, float]:
    """The client module's evaluation of ``client_id``'s ``split`` set with its image j sent to model ``routes[j]``."""
    module = ctx.module
    net, norm = module.net, module.input_norm
    module.net, module.input_norm = _RoutedNet(models, routes), nn.Identity()
    try:
        return module.evaluate(ctx.data.client_eval_loader(client_id, split), ctx.device)
    finally:
        module.net, module.input_norm = net, norm


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
