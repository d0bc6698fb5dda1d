"""Partitioners: exact cover, determinism, the skew each scheme promises, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from datamodules.partition import (
    PARTITION_SCHEMES,
    partition,
    partition_by_domain,
    partition_dirichlet,
    partition_dirichlet_domains,
    partition_iid,
    partition_pathological,
)

NUM_CLASSES = 10
LABELS = np.random.default_rng(123).integers(0, NUM_CLASSES, size=2000)
DOMAINS = np.random.default_rng(7).integers(0, 4, size=2000)


def _run(scheme: str, seed: int, num_clients: int = 8) -> list[np.ndarray]:
    return partition(LABELS, scheme, num_clients, seed, alpha=0.5, classes_per_client=3, domains=DOMAINS)


def _shares(parts: list[np.ndarray]) -> np.ndarray:
    """Per-client class proportions, shape (clients, classes)."""
    counts = np.stack([np.bincount(LABELS[p], minlength=NUM_CLASSES) for p in parts]).astype(float)
    return counts / counts.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_disjoint_complete_sorted_nonempty(scheme: str) -> None:
    parts = _run(scheme, seed=0)
    assert len(parts) == 8
    merged = np.concatenate(parts)
    assert len(merged) == len(LABELS)
    np.testing.assert_array_equal(np.sort(merged), np.arange(len(LABELS)))
    for p in parts:
        assert len(p) > 0
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_deterministic_under_seed_and_varies_across_seeds(scheme: str) -> None:
    a, b, c = _run(scheme, seed=1), _run(scheme, seed=1), _run(scheme, seed=2)
    for pa, pb in zip(a, b, strict=True):
        np.testing.assert_array_equal(pa, pb)
    assert any(len(pa) != len(pc) or not np.array_equal(pa, pc) for pa, pc in zip(a, c, strict=True))


def test_dirichlet_small_alpha_is_far_more_skewed_than_large_alpha() -> None:
    skewed = _shares(partition_dirichlet(LABELS, 10, alpha=0.1, seed=0)).max(axis=1).mean()
    flat = _shares(partition_dirichlet(LABELS, 10, alpha=100.0, seed=0)).max(axis=1).mean()
    assert skewed > 0.35
    assert flat < 0.2
    assert skewed > 2.5 * flat


def test_dirichlet_large_alpha_approaches_uniform_proportions() -> None:
    parts = partition_dirichlet(LABELS, 5, alpha=1e4, seed=3)
    sizes = np.array([len(p) for p in parts])
    np.testing.assert_allclose(sizes / len(LABELS), 0.2, atol=0.02)
    np.testing.assert_allclose(_shares(parts), 1 / NUM_CLASSES, atol=0.03)


def test_dirichlet_respects_min_size() -> None:
    parts = partition_dirichlet(LABELS, 10, alpha=0.1, seed=5, min_size=40)
    assert min(len(p) for p in parts) >= 40


def test_dirichlet_hopeless_request_names_a_client_and_suggests_a_fix() -> None:
    labels = np.repeat(np.arange(2), 3)  # 6 samples, 2 classes
    with pytest.raises(ValueError, match=r"client \d+ .*alpha or fewer clients"):
        partition_dirichlet(labels, 6, alpha=0.01, seed=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_gives_exactly_k_classes(k: int) -> None:
    parts = partition_pathological(LABELS, 10, classes_per_client=k, seed=0)
    for p in parts:
        assert len(np.unique(LABELS[p])) == k


def test_pathological_impossible_requests_raise() -> None:
    with pytest.raises(ValueError, match="classes_per_client"):
        partition_pathological(LABELS, 4, classes_per_client=11, seed=0)
    with pytest.raises(ValueError, match="cannot cover all 10 classes"):
        partition_pathological(LABELS, 3, classes_per_client=2, seed=0)
    # A class with 1 sample cannot give a shard to the several clients assigned to it.
    labels = np.array([0] * 50 + [1])
    with pytest.raises(ValueError, match=r"client \d+ received no samples of class"):
        partition_pathological(labels, 4, classes_per_client=1, seed=0)


def test_by_domain_gives_each_client_only_its_domain() -> None:
    parts = partition_by_domain(DOMAINS, 6, seed=0)
    for client, p in enumerate(parts):
        np.testing.assert_array_equal(np.unique(DOMAINS[p]), [client % 4])


def test_by_domain_needs_a_client_per_domain() -> None:
    with pytest.raises(ValueError, match="number of domains"):
        partition_by_domain(DOMAINS, 3, seed=0)


def test_dirichlet_domains_skews_domains() -> None:
    parts = partition_dirichlet_domains(DOMAINS, 6, beta=0.05, seed=0)
    shares = [np.bincount(DOMAINS[p], minlength=4).max() / len(p) for p in parts]
    assert np.mean(shares) > 0.6


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_more_clients_than_samples_names_a_client(scheme: str) -> None:
    labels = np.array([0, 1, 0])
    with pytest.raises(ValueError, match=r"client \d+ received"):
        partition(labels, scheme, 5, seed=0, classes_per_client=1, domains=np.array([0, 0, 0]))


def test_iid_sizes_balanced() -> None:
    sizes = [len(p) for p in partition_iid(LABELS, 7, seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_unknown_scheme_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="iid, dirichlet, pathological, domain, dirichlet_domain"):
        partition(LABELS, "quantity", 4, seed=0)


def test_domain_schemes_require_domains() -> None:
    with pytest.raises(ValueError, match="domains"):
        partition(LABELS, "domain", 4, seed=0)
