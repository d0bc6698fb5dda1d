"""Deep Domain Isolation with sample-clustered FL: its callback, the cluster selector and its plots."""

from callbacks.ddi.domain_isolation import DomainIsolation

__all__ = ["DomainIsolation"]
