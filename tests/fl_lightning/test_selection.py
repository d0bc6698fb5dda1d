"""Client sampling and the peer-to-peer successor order."""

import pytest

from fl_lightning.server.selection import num_selected, random_cycle, select_clients

IDS = [f"site{i}" for i in range(10)]


def test_fraction_and_count():
    assert num_selected(10, 0.3, None) == 3
    assert num_selected(10, 0.01, None) == 1  # at least one client
    assert num_selected(10, 0.3, 7) == 7  # a count overrides the fraction
    with pytest.raises(ValueError, match="clients_per_round=11"):
        num_selected(10, 1.0, 11)


def test_selection_is_seeded_and_changes_over_rounds():
    a = [select_clients(IDS, r, seed=0, k=3) for r in range(5)]
    assert a == [select_clients(IDS, r, seed=0, k=3) for r in range(5)]
    assert all(len(s) == 3 and len(set(s)) == 3 for s in a)
    assert len({tuple(s) for s in a}) > 1
    assert a != [select_clients(IDS, r, seed=1, k=3) for r in range(5)]
    assert select_clients(IDS, 0, 0, 10) == IDS


def test_random_cycle_is_one_cycle_and_seeded():
    orders = []
    for r in range(4):
        succ = random_cycle(IDS, r, seed=0)
        node, seen = IDS[0], []
        for _ in IDS:
            seen.append(node)
            node = succ[node]
        assert node == IDS[0] and sorted(seen) == sorted(IDS)  # back at the start after visiting all nodes
        orders.append(succ)
        assert succ == random_cycle(IDS, r, seed=0)
    assert len({tuple(sorted(o.items())) for o in orders}) > 1
