"""Pure, seeded partitioners that split sample indices over federated clients.

Every function takes integer label (or domain) arrays and a seed and returns one sorted index array per client.
The arrays are disjoint and together cover every sample exactly once. A client left without samples is an error
that names the client, because a silently empty client breaks aggregation weights and evaluation later on.
"""

from __future__ import annotations

import math

import numpy as np

PARTITION_SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "pathological", "domain", "dirichlet_domain")

# Resampling bound for the Dirichlet scheme: enough for any sensible (alpha, clients) pair, small enough to fail
# fast on hopeless ones.
_MAX_DIRICHLET_TRIES = 100


def _as_int_array(values: np.ndarray, name: str) -> np.ndarray:
    """Checks that ``values`` is a 1-D array of non-negative integers and returns it as int64."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.size and array.min() < 0:
        raise ValueError(f"{name} must be non-negative, got {int(array.min())}")
    return array


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_samples < num_clients:
        # Name the first client that cannot get a sample so the message matches the other empty-client errors.
        raise ValueError(
            f"client {num_samples} received no samples: {num_clients} clients requested but only {num_samples} "
            "samples exist; use fewer clients"
        )


def min_samples_for_test(test_fraction: float) -> int:
    """The fewest samples a client needs to get one test sample and keep one training sample.

    Mirrors :func:`datamodules.split.split_train_test`, which holds out ``round(n * test_fraction)`` samples
    (at most ``n - 1``): that is at least one once ``n * test_fraction >= 0.5`` and ``n >= 2``.
    """
    if test_fraction <= 0:
        return 1
    return max(2, math.ceil(0.5 / test_fraction - 1e-12))


def check_clients_fit(
    num_samples: int,
    num_clients: int,
    test_fraction: float,
    source: str,
    max_samples_per_client: int | None = None,
) -> None:
    """Fail before partitioning when the data cannot give every client a training and a test sample.

    Without this check such a run (e.g. 1,500 clients on 1,797 images) builds 1,500 one-image clients with empty
    test sets and trains for minutes before anything looks wrong.

    Args:
        num_samples: Samples in the pooled data.
        num_clients: Clients requested.
        test_fraction: Per-client test fraction.
        source: The data's name, for the message.
        max_samples_per_client: The per-client cap, if any.

    Raises:
        ValueError: With the numbers and the largest number of clients the data can serve.
    """
    need = min_samples_for_test(test_fraction)
    what = "a training and a test sample" if test_fraction > 0 else "a training sample"
    if num_samples < num_clients * need:
        raise ValueError(
            f"{source}: {num_samples} samples cannot give each of {num_clients} clients {what}: at "
            f"test_fraction={test_fraction} a client needs at least {need} samples, so at most "
            f"{num_samples // need} clients fit; use fewer clients"
        )
    if max_samples_per_client is not None and max_samples_per_client < need:
        raise ValueError(
            f"{source}: max_samples_per_client={max_samples_per_client} leaves every client without {what}: at "
            f"test_fraction={test_fraction} a client needs at least {need} samples"
        )


def _check_nonempty(parts: list[np.ndarray], hint: str) -> list[np.ndarray]:
    for client, part in enumerate(parts):
        if len(part) == 0:
            raise ValueError(f"client {client} received no samples; {hint}")
    return parts


def _finish(buckets: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Concatenates and sorts each client's index chunks."""
    return [np.sort(np.concatenate(chunks)) if chunks else np.empty(0, dtype=np.int64) for chunks in buckets]


def partition_iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Splits samples uniformly at random into ``num_clients`` near-equal parts.

    Args:
        labels: Integer labels, one per sample (only the length is used).
        num_clients: Number of clients.
        seed: Seed for the shuffle.

    Returns:
        One sorted int64 index array per client.

    Raises:
        ValueError: If there are fewer samples than clients (naming the first empty client).

    """
    labels = _as_int_array(labels, "labels")
    _check_num_clients(num_clients, len(labels))
    perm = np.random.default_rng(seed).permutation(len(labels))
    parts = [np.sort(part) for part in np.array_split(perm, num_clients)]
    return _check_nonempty(parts, "use fewer clients")


def _dirichlet_once(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """One draw of the Hsu et al. (2019) scheme: per class, client shares ~ Dir(alpha * 1)."""
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(idx)).astype(np.int64)
        for client, chunk in enumerate(np.split(idx, cuts)):
            buckets[client].append(chunk)
    return _finish(buckets)


def _dirichlet(
    labels: np.ndarray, num_clients: int, concentration: float, seed: int, min_size: int, what: str, param: str
) -> list[np.ndarray]:
    labels = _as_int_array(labels, what)
    if concentration <= 0:
        raise ValueError(f"{param} must be > 0, got {concentration}")
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    _check_num_clients(num_clients, len(labels))
    if len(labels) < num_clients * min_size:
        raise ValueError(
            f"client {len(labels) // min_size} received fewer than min_size={min_size} samples: {len(labels)} samples "
            f"cannot give {num_clients} clients {min_size} each; use fewer clients or a smaller min_size"
        )
    # One generator for all tries: the sequence of retries is itself determined by the seed.
    rng = np.random.default_rng(seed)
    for _ in range(_MAX_DIRICHLET_TRIES):
        parts = _dirichlet_once(labels, num_clients, concentration, rng)
        sizes = [len(part) for part in parts]
        if min(sizes) >= min_size:
            return parts
    smallest = int(np.argmin(sizes))
    got = "no samples" if sizes[smallest] == 0 else f"only {sizes[smallest]} samples (min_size={min_size})"
    raise ValueError(
        f"client {smallest} still received {got} after {_MAX_DIRICHLET_TRIES} seeded Dirichlet draws with "
        f"{param}={concentration} over {num_clients} clients; use a larger {param} or fewer clients"
    )


def partition_dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Label-skewed split: for each class, client shares are drawn from Dir(alpha) (Hsu et al., 2019).

    Small ``alpha`` (e.g. 0.1) gives each client a few dominant classes; large ``alpha`` (e.g. 100) approaches an
    IID split. The whole draw is repeated (seeded, at most 100 times) until every client has ``min_size`` samples.

    Args:
        labels: Integer class labels, one per sample.
        num_clients: Number of clients.
        alpha: Dirichlet concentration (> 0).
        seed: Seed for the shuffles and Dirichlet draws.
        min_size: Minimum number of samples every client must receive.

    Returns:
        One sorted int64 index array per client.

    Raises:
        ValueError: If a client stays below ``min_size`` after all retries (naming the client), or on bad arguments.

    """
    return _dirichlet(labels, num_clients, alpha, seed, min_size, what="labels", param="alpha")


def partition_dirichlet_domains(
    domains: np.ndarray, num_clients: int, beta: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Domain-skewed split: the Dirichlet scheme of :func:`partition_dirichlet` applied to domain labels.

    Args:
        domains: Integer domain (site/style) ids, one per sample.
        num_clients: Number of clients.
        beta: Dirichlet concentration over domains (> 0); small values give each client few domains.
        seed: Seed for the shuffles and Dirichlet draws.
        min_size: Minimum number of samples every client must receive.

    Returns:
        One sorted int64 index array per client.

    Raises:
        ValueError: If a client stays below ``min_size`` after all retries (naming the client), or on bad arguments.

    """
    return _dirichlet(domains, num_clients, beta, seed, min_size, what="domains", param="beta")


def partition_pathological(
    labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int
) -> list[np.ndarray]:
    """Shard split in the style of McMahan et al. (2017): every client holds exactly ``classes_per_client`` classes.

    The ``num_clients * k`` class slots are filled by cycling through a seeded permutation of the classes, so each
    client's ``k`` consecutive slots are distinct classes and the classes are used as evenly as possible. Each
    class's samples are then shuffled and cut into one shard per client holding that class.

    Args:
        labels: Integer class labels, one per sample.
        num_clients: Number of clients.
        classes_per_client: Number of distinct classes per client (``k``).
        seed: Seed for the class assignment and shard cuts.

    Returns:
        One sorted int64 index array per client.

    Raises:
        ValueError: If ``k`` exceeds the number of classes, if ``num_clients * k`` slots cannot cover every class
            (some samples would belong to nobody), or if a class has fewer samples than clients holding it.

    """
    labels = _as_int_array(labels, "labels")
    _check_num_clients(num_clients, len(labels))
    classes = np.unique(labels)
    k = classes_per_client
    if not 1 <= k <= len(classes):
        raise ValueError(f"classes_per_client must be in [1, {len(classes)}] (the number of classes), got {k}")
    if num_clients * k < len(classes):
        raise ValueError(
            f"pathological split impossible: {num_clients} clients x {k} classes = {num_clients * k} shards cannot "
            f"cover all {len(classes)} classes; increase classes_per_client or num_clients"
        )
    rng = np.random.default_rng(seed)
    class_order = rng.permutation(classes)
    slots = class_order[np.arange(num_clients * k) % len(classes)]
    # Shuffle which client gets which group of k slots so client 0 is not always first in the class order.
    client_order = rng.permutation(num_clients)
    client_classes = {int(client_order[g]): slots[g * k : (g + 1) * k] for g in range(num_clients)}

    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for client in range(num_clients):
        for cls in client_classes[client]:
            holders[int(cls)].append(client)

    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls, clients in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == cls))
        if len(idx) < len(clients):
            raise ValueError(
                f"client {clients[len(idx)]} received no samples of class {cls}: the class has {len(idx)} samples "
                f"but {len(clients)} clients need a shard of it; use fewer clients or fewer classes_per_client"
            )
        for client, shard in zip(clients, np.array_split(idx, len(clients)), strict=True):
            buckets[client].append(shard)
    return _check_nonempty(_finish(buckets), "use fewer clients")


def partition_by_domain(domains: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Feature-shift split: client ``i`` gets samples of domain ``i % D`` only.

    Domains are the sorted distinct values of ``domains``; the samples of a domain are split IID among the clients
    assigned to it.

    Args:
        domains: Integer domain (site/style) ids, one per sample.
        num_clients: Number of clients (at least the number of distinct domains, so no domain is dropped).
        seed: Seed for the IID split within each domain.

    Returns:
        One sorted int64 index array per client.

    Raises:
        ValueError: If ``num_clients`` is smaller than the number of domains, or a client ends empty (naming it).

    """
    domains = _as_int_array(domains, "domains")
    _check_num_clients(num_clients, len(domains))
    unique = np.unique(domains)
    if num_clients < len(unique):
        raise ValueError(
            f"partition by domain needs num_clients >= number of domains ({len(unique)}), got {num_clients}; "
            "samples of the extra domains would belong to no client"
        )
    rng = np.random.default_rng(seed)
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for d, domain in enumerate(unique):
        clients = list(range(d, num_clients, len(unique)))
        idx = rng.permutation(np.flatnonzero(domains == domain))
        for client, chunk in zip(clients, np.array_split(idx, len(clients)), strict=True):
            buckets[client].append(chunk)
    return _check_nonempty(_finish(buckets), "its domain has fewer samples than the clients sharing it")


def partition(
    labels: np.ndarray,
    scheme: str,
    num_clients: int,
    seed: int,
    *,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    domains: np.ndarray | None = None,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Dispatches to a partitioner by name.

    Args:
        labels: Integer class labels, one per sample.
        scheme: One of ``"iid"``, ``"dirichlet"``, ``"pathological"``, ``"domain"``, ``"dirichlet_domain"``.
        num_clients: Number of clients.
        seed: Seed for the partitioner.
        alpha: Dirichlet concentration; for ``"dirichlet_domain"`` it is the concentration over domains (beta).
        classes_per_client: Classes per client for ``"pathological"``.
        domains: Domain id per sample, required by ``"domain"`` and ``"dirichlet_domain"``.
        min_size: Minimum samples per client for the Dirichlet schemes.

    Returns:
        One sorted int64 index array per client.

    Raises:
        ValueError: On an unknown scheme (listing the valid ones), missing or misaligned ``domains``, or any error
            of the chosen partitioner.

    """
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; valid schemes: {', '.join(PARTITION_SCHEMES)}")
    if scheme in ("domain", "dirichlet_domain"):
        if domains is None:
            raise ValueError(f"partition scheme {scheme!r} needs a domain id per sample (domains=...)")
        if len(domains) != len(labels):
            raise ValueError(f"domains has {len(domains)} entries but labels has {len(labels)}")
    if scheme == "iid":
        return partition_iid(labels, num_clients, seed)
    if scheme == "dirichlet":
        return partition_dirichlet(labels, num_clients, alpha, seed, min_size=min_size)
    if scheme == "pathological":
        return partition_pathological(labels, num_clients, classes_per_client, seed)
    if scheme == "domain":
        return partition_by_domain(domains, num_clients, seed)
    return partition_dirichlet_domains(domains, num_clients, alpha, seed, min_size=min_size)
