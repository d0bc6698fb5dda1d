"""The shape check of a network given by class path (``model.init_args.net``): one dummy batch, before training.

A client module built around a user's ``torch.nn.Module`` (a MONAI ``DenseNet121``, a ``UNet``, a module of
one's own) cannot know from its class what it takes and returns; a net built for three channels and two classes
on data with one channel and ten classes would otherwise fail, or worse, train, somewhere inside the first local
fit. :func:`check_net_shapes` runs the net once on a zero batch of the data's shape and refuses it with the
expected and the actual shapes, naming the config key, while the config is being instantiated (before any
client trains). The check changes nothing: train/eval flags, buffers and the random generators are as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from fl_lightning.models.layer_kinds import CONVS

NET_KEY = "model.init_args.net"  # the config key of a class-path network (named in every error)
DUMMY_BATCH = 2  # samples of the dummy batch (two, so that a net that drops the batch dimension is caught)


def class_name(net: nn.Module) -> str:
    """``module.Class`` of ``net``, as a class path names it."""
    return f"{type(net).__module__}.{type(net).__qualname__}"


def _first_conv_channels(net: nn.Module) -> tuple[str, int] | None:
    """``(name, in_channels)`` of the net's first convolution in registration order (a hint, not a rule)."""
    for name, sub in net.named_modules():
        if isinstance(sub, CONVS):
            return name, sub.in_channels
    return None


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def check_net_shapes(
    net: nn.Module,
    in_channels: int,
    image_size: tuple[int, int],
    expected: tuple[int, ...],
    meaning: str,
    key: str = NET_KEY,
) -> None:
    """Run ``net`` on a zero batch of the data's shape; refuse it unless its output has shape ``expected``.

    The net runs in eval mode without gradients on the device and dtype of its first parameter (CPU and float32
    for a net without parameters); afterwards every submodule's train/eval flag, every buffer and the CPU random
    generator are restored, so a run with the check is the run without it. Lazy modules (``nn.LazyLinear``) are
    materialised by the pass, as the Federation needs (it takes the initial state right after construction).

    Args:
        net: The network.
        in_channels: Image channels of the data (``data.in_channels``).
        image_size: Input (height, width) of the data (``data.image_size``).
        expected: The output shape a batch of :data:`DUMMY_BATCH` images must give, e.g. ``(2, num_classes)``.
        meaning: What ``expected`` is, for the message (e.g. ``"(N, data.num_classes=10) logits"``).
        key: The config key that named the net.

    Raises:
        ValueError: If the net fails on the batch (wrong input channels, an image size it cannot take) or returns
            anything but a tensor of shape ``expected``; one line naming ``key``, the net's class, the input shape
            and the expected and actual output shapes.

    """
    h, w = (int(s) for s in image_size)
    in_shape = (DUMMY_BATCH, int(in_channels), h, w)
    data = f"data.in_channels={in_channels}, data.image_size={(h, w)}"
    where = f"{key} ({class_name(net)})"
    param = next(net.parameters(), None)
    device, dtype = (param.device, param.dtype) if param is not None else (torch.device("cpu"), torch.float32)
    modes = [(m, m.training) for m in net.modules()]
    # A lazy module's buffers are created by this forward pass, with their initial values: nothing to restore.
    buffers = [(b, b.detach().clone()) for b in net.buffers() if not is_lazy(b)]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            net.eval()
            out = net(torch.zeros(in_shape, device=device, dtype=dtype))
    except Exception as err:  # noqa: BLE001 - any failure of the user's net is reported with the shapes
        detail = " ".join(f"{type(err).__name__}: {err}".split()).rstrip(".")
        conv = _first_conv_channels(net)
        hint = f" Check that the net takes {in_channels}-channel images of {h}x{w} px (data.image_size)."
        if conv is not None and conv[1] != in_channels:
            hint = (
                f" Its first convolution `{conv[0]}` takes {conv[1]} input channels, the data has {in_channels}: "
                f"set the net's input channels (MONAI: in_channels) to {in_channels}."
            )
        raise ValueError(
            f"{where} does not take the data's images: a dummy batch of shape {_shape(in_shape)} ({data}) "
            f"raised {detail}.{hint}"
        ) from None
    finally:
        for module, training in modes:
            module.training = training
        for buffer, saved in buffers:
            buffer.copy_(saved)
    if not isinstance(out, Tensor):
        raise ValueError(
            f"{where} returns {type(out).__name__}, not a tensor, on a dummy batch of shape {_shape(in_shape)} "
            f"({data}); expected a tensor of shape {_shape(expected)}: {meaning}"
        )
    actual = tuple(out.shape)
    if actual != tuple(expected):
        if len(actual) == len(expected) and actual[1] != expected[1]:
            hint = f" Set the net's number of outputs (MONAI: out_channels) to {expected[1]}."
        elif len(actual) == len(expected) and len(expected) > 2:
            hint = " The output must keep the input's height and width."
        else:
            hint = ""
        raise ValueError(
            f"{where} returns shape {_shape(actual)} on a dummy batch of shape {_shape(in_shape)} ({data}); "
            f"expected {_shape(expected)}: {meaning}.{hint}"
        )
