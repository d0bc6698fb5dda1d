"""The federated datamodule base: per-client tensors in memory, per-client seeded loaders."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset, default_collate

from datamodules.sampler import SeededEpochSampler, stable_seed
from datamodules.shifts import style_name
from datamodules.split_checks import check_splits
from datamodules.validation import with_validation

POOLED_KEY = "__pooled__"
SAMPLE_KINDS = ("image", "table")
LABEL_KINDS = ("class", "survival")


class SampleBatch(Sequence[tuple[Tensor, ...]]):
    """The samples of one batch, read at once: a sequence of per-sample tuples, and the batched tensors.

    Any collate function sees what :class:`~torch.utils.data.TensorDataset` gives it (``batch[i]`` is sample
    ``i``'s tuple); :func:`keep_batch` takes the tensors as they are.
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tuple(t[i] for t in self.tensors)


class BatchTensorDataset(TensorDataset):
    """A :class:`~torch.utils.data.TensorDataset` that a DataLoader reads one batch at a time.

    The DataLoader hands :meth:`__getitems__` a batch's indices; each tensor is indexed once, instead of once per
    sample. With :func:`keep_batch` as the loader's ``collate_fn`` the batch is used as read (no stacking): the same
    tensors, value for value, as ``TensorDataset`` with default collation gives (a list, one tensor per field). A
    loader given another collate function (a subclass's augmentation) gets the batch's samples, as before.
    """

    def __getitems__(self, indices: list[int]) -> SampleBatch:
        index = torch.as_tensor(indices, dtype=torch.long)
        return SampleBatch([t[index] for t in self.tensors])


def keep_batch(batch: Sequence[Any]) -> Any:
    """The collate function of :class:`BatchTensorDataset` loaders: a :class:`SampleBatch` is already one."""
    if isinstance(batch, SampleBatch):
        return list(batch.tensors)
    return default_collate(batch)


def batch_loader(tensors: Sequence[Tensor], batch_size: int, generator: torch.Generator, **kwargs: Any) -> DataLoader:
    """A DataLoader over ``tensors`` that reads a batch at a time (:class:`BatchTensorDataset`, :func:`keep_batch`)."""
    return DataLoader(
        BatchTensorDataset(*tensors),
        batch_size=batch_size,
        num_workers=0,
        collate_fn=keep_batch,
        generator=generator,
        **kwargs,
    )


@dataclass
class ClientSplit:
    """One client's data, already partitioned, styled and split.

    Attributes:
        client_id: Unique id of the client (e.g. ``"site0"``; never ``"__pooled__"``); keys its loaders and seeds
            its sampler.
        train_x: Training images, float32 (N, C, H, W) in [0, 1] (rows of a table: float32 (N, F)).
        train_y: Training labels, int64 (N,), or segmentation masks, int64 (N, H, W) of class ids, or survival
            labels, float32 (N, 2) of (time, event).
        test_x: Test images, float32 (M, C, H, W) in [0, 1].
        test_y: Test labels, int64 (M,), or masks (M, H, W).
        train_domain: Optional domain (site style) id per training sample, int64 (N,).
        test_domain: Optional domain (site style) id per test sample, int64 (M,).
        val_x: Validation images (V, C, H, W): an official validation split a loader found, or None (then
            ``val_fraction`` carves one out of the training data when the datamodule is loaded; after loading every
            client has validation tensors, empty without a split).
        val_y: Validation labels (V,) or masks (V, H, W), with ``val_x``.
        val_domain: Optional domain id per validation sample (V,).
        train_case: Optional case (patient, volume, scan) id per training sample, int64 (N,): a carved validation
            split takes whole cases, so no case is in both.

    """

    client_id: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    train_domain: Tensor | None = None
    test_domain: Tensor | None = None
    val_x: Tensor | None = None
    val_y: Tensor | None = None
    val_domain: Tensor | None = None
    train_case: Tensor | None = None


def loader_generator(seed: int, *key: str) -> torch.Generator:
    """A DataLoader's own generator, so that creating its iterators never draws from torch's global generator.

    Every ``iter(DataLoader)`` draws a base seed (used only by worker processes) from the loader's generator, or
    from the global one when it has none. Lightning creates one training iterator on a Trainer's first fit and two
    on every later fit (``TrainingEpochLoop.on_run_start`` re-iterates once ``current_epoch > 0``). A resumed
    process's first fit comes in a later round, so with the global generator it would be one draw behind the
    uninterrupted run and every dropout mask or random augmentation after it would differ. With its own generator
    the global stream holds only what the model and the data transforms draw, which the round checkpoints restore.

    Args:
        seed: The datamodule's seed.
        key: What the loader serves (client id, ``"eval"``...), for a distinct stream per loader.

    Returns:
        A seeded CPU generator.
    """
    return torch.Generator().manual_seed(stable_seed(seed, "loader", *key))


def check_image_args(image_size: int, channels: int) -> None:
    """Validate the image shape arguments every image datamodule takes, naming the bad one.

    Raises:
        ValueError: If ``image_size`` < 1 or ``channels`` is not 1 or 3.
    """
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")


class FederatedDataModule(L.LightningDataModule):
    """Abstract base of the federated datamodules: gives per-client and pooled loaders over cached tensors.

    Subclasses implement :meth:`_load`, which is called once, lazily (by the first property or loader access, or
    by :meth:`setup`), and returns every client's :class:`ClientSplit`. Data never changes afterwards, so a client's
    data is identical across rounds.

    Training loaders shuffle with one persistent :class:`SeededEpochSampler` per client, seeded with
    ``stable_seed(seed, client_id)``: a client's batches depend only on the seed, the client and how many times its
    loader has been iterated, never on other clients or on the shared Trainer's epoch.

    Args:
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's samples held out as its test set, in [0, 1).
        seed: Seed for partitioning, styling, splitting and shuffling.
        val_fraction: Fraction of each client's **training** samples held out as its validation set, in [0, 1)
            (:func:`~datamodules.validation.carve_validation`: seeded per client, stratified by label for
            classification, by whole cases where the data know them). 0 (the default) keeps the training data as
            they are, bit for bit. A client whose data ship an official validation split uses it instead.

    Attributes:
        sample_kind: ``"image"`` (samples (C, H, W) in [0, 1]) or ``"table"`` (rows of F standardised features,
            unbounded); a subclass of tables sets ``"table"``. Image-only methods refuse tables by it.
        label_kind: ``"class"`` (int64 class ids, or masks) or ``"survival"`` (float32 ``(time, event)`` pairs;
            :meth:`label_counts` then counts censored and event samples).

    Raises:
        ValueError: If a batch size is not positive or ``test_fraction`` or ``val_fraction`` is outside [0, 1).

    """

    sample_kind: ClassVar[str] = "image"
    label_kind: ClassVar[str] = "class"

    def __init__(
        self,
        *,
        batch_size: int = 32,
        eval_batch_size: int = 256,
        test_fraction: float = 0.2,
        seed: int = 0,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1, got {eval_batch_size}")
        if not 0.0 <= test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.val_fraction = val_fraction
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.test_fraction = test_fraction
        self.seed = seed
        # Subclasses set these before the first load: a declared class count (None = infer) and a source name
        # (file, directory or "digits") used in error messages.
        self._declared_num_classes: int | None = None
        self._source: str = type(self).__name__
        self._splits: dict[str, ClientSplit] | None = None
        self._num_classes: int = 0
        self._samplers: dict[str, SeededEpochSampler] = {}
        self._pooled: tuple[Tensor, Tensor] | None = None

    # ----------------------------------------------------------------------------------------------- loading

    @abstractmethod
    def _load(self) -> list[ClientSplit]:
        """Builds every client's data. Called once; the result is validated and cached.

        Returns:
            One :class:`ClientSplit` per client, in client order.

        """
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Loads the data (once). Nothing is downloaded.

        Args:
            stage: Lightning stage; ignored, all clients' data serves every stage.

        """
        self._ensure_loaded()

    def _ensure_loaded(self) -> dict[str, ClientSplit]:
        if self._splits is None:
            splits = [with_validation(s, self.val_fraction, self.seed, self._source) for s in self._load()]
            self._num_classes = self._validate(splits)
            self._samplers = {
                s.client_id: SeededEpochSampler(len(s.train_y), stable_seed(self.seed, s.client_id)) for s in splits
            }
            total = sum(len(s.train_y) for s in splits)
            self._samplers[POOLED_KEY] = SeededEpochSampler(total, stable_seed(self.seed, POOLED_KEY))
            self._splits = {s.client_id: s for s in splits}
        return self._splits

    def _validate(self, splits: list[ClientSplit]) -> int:
        """Checks the loaded splits; the number of classes (:func:`~datamodules.split_checks.check_splits`)."""
        return check_splits(
            splits, self.sample_kind, self.label_kind, self._declared_num_classes, self._source, POOLED_KEY
        )

    # -------------------------------------------------------------------------------------------- properties

    @property
    def client_ids(self) -> list[str]:
        """Ids of every client, in the order :meth:`_load` returned them (the first access loads the data)."""
        return list(self._ensure_loaded())

    @property
    def num_classes(self) -> int:
        """Number of classes (declared by the subclass, else max label + 1 over all clients)."""
        self._ensure_loaded()
        return self._num_classes

    @property
    def in_channels(self) -> int:
        """Channels C of every image (all clients share one image shape); 1 for a table (a row is a 1 × F image)."""
        if self.sample_kind == "table":
            return 1
        return int(self._first().train_x.shape[1])

    @property
    def image_size(self) -> tuple[int, int]:
        """``(height, width)`` of every image in pixels (all clients share one image shape); ``(1, F)`` for a table.

        A table has no images: an image network linked to its shape sees a 1 × F image (an MLP then takes the F
        features; a CNN's shape check refuses the rows with both shapes).
        """
        x = self._first().train_x
        if self.sample_kind == "table":
            return 1, int(x.shape[1])
        return int(x.shape[2]), int(x.shape[3])

    @property
    def num_features(self) -> int:
        """Inputs per sample: a table's feature columns (after one-hot encoding), an image's C·H·W values."""
        return int(self._first().train_x[0].numel())

    def _first(self) -> ClientSplit:
        return next(iter(self._ensure_loaded().values()))

    def client_data(self, client_id: str) -> ClientSplit:
        """Returns a client's cached tensors (do not modify them in place).

        Args:
            client_id: One of :attr:`client_ids`.

        Returns:
            The client's :class:`ClientSplit`.

        Raises:
            KeyError: If the client id is unknown (listing the valid ids).

        """
        splits = self._ensure_loaded()
        if client_id not in splits:
            raise KeyError(f"unknown client id {client_id!r}; valid ids: {', '.join(splits)}")
        return splits[client_id]

    def num_train_samples(self, client_id: str) -> int:
        """Number of training samples of a client (its FedAvg weight).

        Args:
            client_id: One of :attr:`client_ids`.

        Returns:
            The length of the client's training set (images, not pixels, for segmentation).

        Raises:
            KeyError: If the client id is unknown.

        """
        return len(self.client_data(client_id).train_y)

    def num_test_samples(self, client_id: str) -> int:
        """Number of test samples of a client.

        Args:
            client_id: One of :attr:`client_ids`.

        Returns:
            The length of the client's test set (images, not pixels, for segmentation).

        Raises:
            KeyError: If the client id is unknown.

        """
        return len(self.client_data(client_id).test_y)

    def num_val_samples(self, client_id: str) -> int:
        """Number of validation samples of a client (0 without a validation split).

        Raises:
            KeyError: If the client id is unknown.
        """
        return len(self.client_data(client_id).val_y)

    @property
    def has_validation(self) -> bool:
        """Whether any client has a validation sample (``val_fraction`` > 0 or an official split)."""
        return any(len(s.val_y) for s in self._ensure_loaded().values())

    def label_names(self) -> list[str] | None:
        """The classes' names (index = class id) where the data have them, else None (figures then show ids)."""
        return None

    def image_sources(self, client_id: str) -> tuple[list[str], str] | None:
        """Where each of the client's training images comes from, for figures such as ``sites.png``.

        With ``site_styles`` (the embedded digits, MedMNIST), an image's domain is its style's index, named by
        :func:`~datamodules.shifts.style_name`; otherwise its domain id, if the data have domains.

        Returns:
            ``(a name per training image, "styles" or "domains")``, or None if the data describe neither.

        Raises:
            KeyError: If ``client_id`` is not one of :attr:`client_ids`.
        """
        domains = self.client_data(client_id).train_domain
        if domains is None:
            return None
        spec = getattr(self, "site_styles", None)
        if spec is not None and spec is not False:
            return [style_name(spec, d) for d in domains.tolist()], "styles"
        return [f"domain {d}" for d in domains.tolist()], "domains"

    def label_counts(self, client_id: str, split: str = "train") -> Tensor:
        """Per-class sample counts of a client.

        Args:
            client_id: One of :attr:`client_ids`.
            split: ``"train"``, ``"val"`` or ``"test"``.

        Returns:
            An int64 tensor of shape (num_classes,): images per class, or pixels per class for segmentation masks.

        Raises:
            KeyError: If the client id is unknown.
            ValueError: If ``split`` is not ``"train"``, ``"val"`` or ``"test"``.

        """
        if split not in ("train", "val", "test"):
            raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
        data = self.client_data(client_id)
        labels = {"train": data.train_y, "val": data.val_y, "test": data.test_y}[split]
        if self.label_kind == "survival":
            labels = labels[:, 1].long()  # censored (0) and event (1) samples
        return torch.bincount(labels.reshape(-1), minlength=self.num_classes).to(torch.int64)

    # ----------------------------------------------------------------------------------------------- loaders

    def _train_loader(self, x: Tensor, y: Tensor, key: str, steps: int | None) -> DataLoader:
        sampler = self._sampler_view(self._samplers[key], steps)
        return batch_loader((x, y), self.batch_size, loader_generator(self.seed, key), sampler=sampler)

    def _sampler_view(self, sampler: SeededEpochSampler, steps: int | None) -> SeededEpochSampler:
        """A view of a persistent sampler: shares its pass counter; with ``steps``, ``steps`` batches per pass."""
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be >= 1 or None, got {steps}")
        return sampler.with_num_samples(steps * self.batch_size if steps is not None else None)

    def _eval_loader(self, x: Tensor, y: Tensor) -> DataLoader:
        return batch_loader((x, y), self.eval_batch_size, loader_generator(self.seed, "eval"), shuffle=False)

    def client_train_loader(self, client_id: str, steps: int | None = None) -> DataLoader:
        """Shuffled training loader of one client, yielding ``(x, y)`` batches.

        Each iteration of the loader is one pass of the client's persistent sampler; with ``steps`` the pass has
        exactly ``steps * batch_size`` samples (wrapping over the data as needed), so exactly ``steps`` batches.

        Args:
            client_id: One of :attr:`client_ids`.
            steps: Number of batches per pass; ``None`` means one epoch over the client's data.

        Returns:
            A DataLoader over the client's training set.

        Raises:
            KeyError: If the client id is unknown.
            ValueError: If ``steps`` is not positive.

        """
        data = self.client_data(client_id)
        return self._train_loader(data.train_x, data.train_y, client_id, steps)

    def client_subset_train_loader(
        self, client_id: str, indices: Tensor, sampler: SeededEpochSampler, steps: int | None = None
    ) -> DataLoader:
        """Shuffled training loader over a subset of one client's samples (sample-clustered FL).

        The caller owns ``sampler`` (one persistent sampler per subset, over ``len(indices)`` positions), so the
        subset's batches depend only on its seed and pass count, like a client's full loader.

        Args:
            client_id: One of :attr:`client_ids`.
            indices: int64 indices into the client's training set.
            sampler: The subset's persistent sampler (``data_len == len(indices)``).
            steps: Number of batches per pass; ``None`` means one epoch over the subset.

        Returns:
            A DataLoader over ``(train_x[indices], train_y[indices])``.

        Raises:
            KeyError: If the client id is unknown.
            ValueError: If the sampler's length differs from the subset's or ``steps`` is not positive.

        """
        if sampler.data_len != len(indices):
            raise ValueError(f"subset sampler of {client_id!r} covers {sampler.data_len} samples, not {len(indices)}")
        view = self._sampler_view(sampler, steps)
        data = self.client_data(client_id)
        generator = loader_generator(self.seed, "subset", client_id)
        return batch_loader((data.train_x[indices], data.train_y[indices]), self.batch_size, generator, sampler=view)

    def client_test_loader(self, client_id: str) -> DataLoader:
        """Unshuffled test loader of one client, yielding ``(x, y)`` batches of ``eval_batch_size``.

        Args:
            client_id: One of :attr:`client_ids`.

        Returns:
            A DataLoader over the client's test set, in its stored order.

        Raises:
            KeyError: If the client id is unknown.

        """
        data = self.client_data(client_id)
        return self._eval_loader(data.test_x, data.test_y)

    def client_val_loader(self, client_id: str) -> DataLoader:
        """Unshuffled validation loader of one client (empty without a validation split), like the test loader.

        Raises:
            KeyError: If the client id is unknown.
        """
        data = self.client_data(client_id)
        return self._eval_loader(data.val_x, data.val_y)

    def client_eval_loader(self, client_id: str, split: str) -> DataLoader:
        """The client's ``"val"`` or ``"test"`` loader.

        Raises:
            KeyError: If the client id is unknown.
            ValueError: If ``split`` is neither.
        """
        if split == "val":
            return self.client_val_loader(client_id)
        if split == "test":
            return self.client_test_loader(client_id)
        raise ValueError(f"split must be 'val' or 'test', got {split!r}")

    def _pooled_tensors(self, split: str) -> tuple[Tensor, Tensor]:
        splits = list(self._ensure_loaded().values())
        if split == "train":
            if self._pooled is None:
                # Cached: the pooled copy is made once, only if someone asks for it (centralised baselines).
                self._pooled = (torch.cat([s.train_x for s in splits]), torch.cat([s.train_y for s in splits]))
            return self._pooled
        if split == "val":
            return torch.cat([s.val_x for s in splits]), torch.cat([s.val_y for s in splits])
        return torch.cat([s.test_x for s in splits]), torch.cat([s.test_y for s in splits])

    def pooled_train_loader(self, steps: int | None = None) -> DataLoader:
        """Shuffled loader over all clients' training data concatenated (centralised baseline).

        Args:
            steps: Number of batches per pass; ``None`` means one epoch.

        Returns:
            A DataLoader with its own persistent sampler (key ``"__pooled__"``).

        """
        x, y = self._pooled_tensors("train")
        return self._train_loader(x, y, POOLED_KEY, steps)

    def pooled_test_loader(self) -> DataLoader:
        """Unshuffled loader over all clients' test sets concatenated, in client order.

        Returns:
            A DataLoader of ``(x, y)`` batches of ``eval_batch_size`` (the concatenation is built on each call).

        """
        return self._eval_loader(*self._pooled_tensors("test"))

    def train_dataloader(self) -> DataLoader:
        """Lightning hook: the pooled training loader (for centralised training with ``trainer.fit(datamodule=)``)."""
        return self.pooled_train_loader()

    def pooled_val_loader(self) -> DataLoader:
        """Unshuffled loader over all clients' validation sets concatenated, in client order."""
        return self._eval_loader(*self._pooled_tensors("val"))

    def val_dataloader(self) -> DataLoader:
        """Lightning hook: the pooled validation loader, or the pooled test loader without a validation split."""
        return self.pooled_val_loader() if self.has_validation else self.pooled_test_loader()

    def test_dataloader(self) -> DataLoader:
        """Lightning hook: the pooled test loader."""
        return self.pooled_test_loader()

    # ------------------------------------------------------------------------------------------------ resume

    def sampler_state(self) -> dict[str, int]:
        """Pass counters of every client's sampler and of the pooled sampler, for round checkpoints.

        Returns:
            ``{client_id: epoch, ..., "__pooled__": epoch}``.

        """
        self._ensure_loaded()
        return {key: sampler.epoch for key, sampler in self._samplers.items()}

    def load_sampler_state(self, state: dict[str, int]) -> None:
        """Restores pass counters saved by :meth:`sampler_state`; samplers absent from ``state`` are left as they are.

        Args:
            state: Mapping of sampler key to epoch.

        Raises:
            KeyError: If ``state`` names an unknown client (listing the valid keys).

        """
        self._ensure_loaded()
        unknown = sorted(set(state) - set(self._samplers))
        if unknown:
            raise KeyError(f"sampler state names unknown clients {unknown}; valid keys: {', '.join(self._samplers)}")
        for key, epoch in state.items():
            self._samplers[key].epoch = int(epoch)

    def state_dict(self) -> dict[str, dict[str, int]]:
        """Lightning hook: the sampler pass counters (so a Trainer checkpoint of the datamodule can resume them).

        Returns:
            ``{"sampler_epochs": sampler_state()}``.

        """
        return {"sampler_epochs": self.sampler_state()}

    def load_state_dict(self, state_dict: dict[str, dict[str, int]]) -> None:
        """Lightning hook: restores what :meth:`state_dict` saved.

        Args:
            state_dict: ``{"sampler_epochs": {...}}``.

        """
        self.load_sampler_state(state_dict.get("sampler_epochs", {}))
