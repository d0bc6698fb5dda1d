"""A metadata table's rows: sites in order, sites split into clients, cells read and path templates filled."""

from __future__ import annotations

import math
import string

import numpy as np

from datamodules.partition import partition
from datamodules.sampler import stable_seed


def site_order(values: list[str]) -> list[str]:
    """The distinct site values in client order: numerically if every one is an integer, else as text.

    Args:
        values: One site value per sample (strings).

    Returns:
        The distinct values, sorted (``"2"`` before ``"10"`` when all are integers).
    """
    distinct = set(values)
    if all(_as_int(v) is not None for v in distinct):
        return sorted(distinct, key=lambda v: (_as_int(v), v))
    return sorted(distinct)


def site_clients(
    site_index: np.ndarray,
    labels: np.ndarray,
    site_names: list[str],
    clients_per_site: int,
    scheme: str,
    seed: int,
    *,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    source: str = "data",
) -> tuple[list[np.ndarray], list[str]]:
    """One client per site, or each site split over ``clients_per_site`` clients by a seeded partitioner.

    Client ids are the site names with one client per site, else ``"<site>_<k>"`` for ``k = 0 .. clients_per_site
    - 1``. A site's split is seeded by ``stable_seed(seed, "partition", site)``: it depends on the seed and the site
    only, not on the other sites.

    Args:
        site_index: Index into ``site_names`` of each sample's site (N,).
        labels: Integer class label of each sample (N,), used by the label-based schemes.
        site_names: The sites, in client order.
        clients_per_site: Clients per site (>= 1).
        scheme: ``"iid"``, ``"dirichlet"`` (over labels, concentration ``alpha``) or ``"pathological"``.
        seed: Base seed.
        alpha: Dirichlet concentration.
        classes_per_client: Classes per client for ``"pathological"``.
        source: The data's name, for the messages.

    Returns:
        ``(index arrays, client ids)``: one sorted int64 array of sample indices per client, and its id.

    Raises:
        ValueError: If a site has no samples or cannot be split into ``clients_per_site`` clients, naming it.
    """
    parts: list[np.ndarray] = []
    ids: list[str] = []
    for s, name in enumerate(site_names):
        idx = np.flatnonzero(site_index == s).astype(np.int64)
        if not len(idx):
            raise ValueError(f"{source}: site {name!r} has no samples")
        if clients_per_site == 1:
            parts.append(idx)
            ids.append(name)
            continue
        try:
            site_parts = partition(
                labels[idx],
                scheme,
                clients_per_site,
                stable_seed(seed, "partition", name),
                alpha=alpha,
                classes_per_client=classes_per_client,
            )
        except ValueError as err:
            raise ValueError(
                f"{source}: site {name!r} ({len(idx)} samples) cannot be split into {clients_per_site} clients "
                f"({scheme}): {err}"
            ) from None
        parts += [idx[p] for p in site_parts]
        ids += [f"{name}_{k}" for k in range(clients_per_site)]
    return parts, ids


def _as_int(value: str) -> int | None:
    """``value`` as an integer if it is one (``"3"``, ``" 3 "``, ``"3.0"``), else None."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number == int(number) else None


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


class _Cell:
    """A cell for a path template: its own text, or a number where the format spec asks for one (``{patient:03d}``).

    Plain ``{column}`` keeps the text exactly as written (``"0012"`` stays ``"0012"``).
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def __format__(self, spec: str) -> str:
        if not spec:
            return self.text
        for number in (int, float):
            try:
                return format(number(self.text), spec)
            except ValueError:
                continue
        return format(self.text, spec)

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def _template_fields(template: str) -> list[str]:
    """The column names a ``str.format`` template refers to (``"{patient:03d}"`` -> ``["patient"]``)."""
    fields = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        name = field.split(".")[0].split("[")[0]
        if not name or name.isdigit():
            raise ValueError(f"path_template {template!r} must name its columns, e.g. '{{patient}}', got {{{field}}}")
        fields.append(name)
    if not fields:
        raise ValueError(f"path_template {template!r} names no column, e.g. 'patches/{{patient}}/{{x_coord}}.png'")
    return fields


def _row(at: tuple[int, int]) -> str:
    """``(row, line)`` as the messages name it: the data row's number (1 = the first after the header), its line."""
    return f"row {at[0]} (line {at[1]})"


def _values(values: list[str | int] | None, name: str) -> list[str] | None:
    """A list option's values as text (a site or split value may be given as a number)."""
    if values is None:
        return None
    out = [str(v).strip() for v in values]
    if len(set(out)) != len(out) or any(not v for v in out):
        raise ValueError(f"{name} must hold distinct, non-empty values, got {values}")
    return out
