"""``federation.mode: evaluate``: the weights file it scores on every client's test set, read and checked.

The weights come from a file: a round checkpoint of ours (its first group's global model), a Lightning checkpoint
(``state_dict``) or a plain state dict saved with ``torch.save``; they are loaded with ``weights_only=True`` (nothing
is unpickled) and must match the configured model key for key and shape for shape
(:meth:`~fl_lightning.server.federation.Federation.run_evaluation` runs the evaluation).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from datamodules.files import load_state_file

if TYPE_CHECKING:
    from fl_lightning.ops.state import StateDict

WEIGHTS_KEY = "federation.weights"


def weights_state(path: Path, expected: StateDict) -> StateDict:
    """The model state held by a weights file, checked against the model's own state ``expected``.

    Raises:
        FileNotFoundError: If the file does not exist.
        RuntimeError: If it is not a readable state file.
        ValueError: If it holds no model state, several groups' models, or keys or shapes other than the model's,
            naming the file and the first differing keys.
    """
    obj = load_state_file(path, f"{WEIGHTS_KEY} file")
    if "groups" in obj and "round" in obj:  # a round checkpoint of ours
        groups = obj["groups"]
        if len(groups) != 1:
            names = [g["name"] for g in groups]
            raise ValueError(f"{WEIGHTS_KEY}={path} is a checkpoint of {len(groups)} models ({names}); evaluate one "
                             "model: save that group's state as a file and give it")  # fmt: skip
        state = groups[0]["state"]
    elif "state_dict" in obj:  # a Lightning checkpoint
        state = obj["state_dict"]
    else:
        state = obj
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{WEIGHTS_KEY}={path} does not fit the configured model: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]} (is the model section the one these weights were trained with?)"
        )
    shapes = [k for k in expected if tuple(state[k].shape) != tuple(expected[k].shape)]
    if shapes:
        k = shapes[0]
        raise ValueError(f"{WEIGHTS_KEY}={path}: {k} has shape {tuple(state[k].shape)}, the model's is "
                         f"{tuple(expected[k].shape)} ({len(shapes)} keys differ)")  # fmt: skip
    return {k: state[k].to(expected[k].dtype) for k in expected}
