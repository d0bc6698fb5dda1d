"""Which Flower site hosts which client: refusing two nodes that claim one client id, the clients' order."""

from __future__ import annotations

from typing import Any


def claim_conflicts(live: dict[int, dict[str, Any]], new: dict[int, dict[str, Any]]) -> dict[int, str]:
    """The newly described nodes to refuse, with why: each client id lives on one site.

    A new node claiming a client that a connected, described node already hosts is refused (the run goes on with
    the first); two new nodes claiming one client are both refused (nobody can tell which is right). A restarted
    site comes back under a new node id after its old one failed a task and lost its description, so it is not
    refused.

    Args:
        live: The described nodes that are still connected, ``{node: description}``.
        new: The nodes described just now, ``{node: description}``.

    """
    owners: dict[str, list[int]] = {}
    for node, desc in [*live.items(), *new.items()]:
        for cid in desc["clients"]:
            owners.setdefault(cid, []).append(node)
    why: dict[int, str] = {}
    for cid, nodes in owners.items():
        if len(nodes) < 2:
            continue
        named = " and ".join(f"SuperNode {n}" for n in nodes)
        message = (
            f"client {cid!r} is claimed by {named}; each client id must live on one site: fix fl-clients in the "
            "node config of the wrong one and restart it"
        )
        for node in nodes:
            if node in new:  # a live node keeps its clients
                why.setdefault(node, message)
    return why


def client_order(client_id: str) -> tuple[int, Any]:
    """Sort key of client ids: numeric ids by value, before the others by name."""
    return (0, int(client_id)) if client_id.isdigit() else (1, client_id)
