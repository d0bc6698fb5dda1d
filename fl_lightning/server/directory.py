"""What a server knows of its clients without holding their data: ids and sizes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClientDirectory:
    """The metadata a :class:`~fl_lightning.server.federation.Federation` reads in place of a datamodule.

    A server needs client ids (to select), training-set sizes (aggregation weights n_i), test-set sizes
    (the summary) and the batch size (throughput); nothing else. A federation whose server must not hold
    the data (e.g. one run through a relay) is given a directory instead of the datamodule.

    Attributes:
        train_sizes: Training samples per client id, in client order.
        test_sizes: Test samples per client id.
        batch_size: The clients' training batch size.
        seed: The data seed.
        val_sizes: Validation samples per client id (empty: the clients have no validation split).

    """

    train_sizes: dict[str, int]
    test_sizes: dict[str, int]
    batch_size: int
    seed: int = 0
    val_sizes: dict[str, int] = field(default_factory=dict)

    @property
    def client_ids(self) -> list[str]:
        """Client ids, in order."""
        return list(self.train_sizes)

    def num_train_samples(self, client_id: str) -> int:
        """Training samples of ``client_id``."""
        return self.train_sizes[client_id]

    def num_test_samples(self, client_id: str) -> int:
        """Test samples of ``client_id``."""
        return self.test_sizes[client_id]

    @property
    def has_validation(self) -> bool:
        """Whether any client has a validation set."""
        return any(self.val_sizes.values())

    def num_val_samples(self, client_id: str) -> int:
        """Validation samples of ``client_id``."""
        return self.val_sizes.get(client_id, 0)
