"""Class-restricted per-sample gradients: the library's vmap extraction vs a Python loop (target: >= 5x faster).

Deep Domain Isolation needs, for every training sample a and every class c present in its mask, the
gradient of the class-c restricted loss (``per_class_losses``) w.r.t. all trainable parameters. The
library computes them with ``torch.func`` (``vmap`` over samples of ``jacrev`` over the class losses, in
chunks of ``--chunk-size``: ``class_restricted_gradients``, which DDI's ``client_features`` calls per
chunk). The baseline is what a user would write: per sample one forward pass, then one
``torch.autograd.grad`` per present class on the same loss definition. Both run the model DDI uses
(``_full_model`` of the config's SegmentationClient: unet width 16 depth 2 instance norm, 5 classes,
seeded) on one batch of real data (the first ``--batch`` training images of site0 of
``configs/scfl_digits_seg.yaml``'s DigitsSegFederated, 32 px, inverted_fraction 0.5). With ``--prune``
both keep the pruned DDI coordinates (``prune_indices``, fraction 0.01; the library prunes after computing
the full gradients, so pruning saves no time). The script checks that both give the same gradients (up to
float32 rounding, and the rare ReLU input within rounding of 0 that batched and single-sample convolutions
put on different sides), then prints the best of ``--repeats`` timed runs (after one warm-up), wall clock
and process CPU time, and the ratio.

    python benchmarks/per_sample_grads.py [--batch 64] [--chunk-size 16] [--prune] [--threads 1] [--repeats 3]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from callbacks.ddi.domain_isolation import _full_model
from datamodules import DigitsSegFederated
from fl_lightning.clients import SegmentationClient
from fl_lightning.ops.per_sample_grads import class_restricted_gradients, per_class_losses, prune_indices

TARGET = 5.0


def task_model_and_batch(batch: int, seed: int) -> tuple[nn.Module, Tensor, Tensor, int]:
    """DDI's model of the task (seeded init) and the first ``batch`` training images of site0."""
    data = DigitsSegFederated(
        num_clients=10, image_size=32, num_samples=1000, inverted_fraction=0.5, partition="iid", site_styles=False,
        batch_size=16, seed=0,
    )  # fmt: skip
    split = data.client_data(data.client_ids[0])
    if len(split.train_y) < batch:
        raise SystemExit(f"--batch {batch}: site0 has only {len(split.train_y)} training images")
    torch.manual_seed(seed)
    client = SegmentationClient(
        num_classes=data.num_classes, in_channels=data.in_channels, image_size=data.image_size, arch="unet",
        width=16, depth=2, norm="instance",
    )  # fmt: skip
    model = _full_model(client, client.state_dict())
    return model, split.train_x[:batch], split.train_y[:batch], data.num_classes


def loop_gradients(model: nn.Module, x: Tensor, y: Tensor, num_classes: int, keep: Tensor | None) -> Tensor:
    """The baseline: per sample one forward, one ``autograd.grad`` per present class; (N, C, P) like the library."""
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() for p in params) if keep is None else len(keep)
    out = torch.zeros(len(x), num_classes, size, device=x.device)
    for a in range(len(x)):
        losses = per_class_losses(model(x[a : a + 1])[0], y[a], num_classes)
        present = [c for c in range(num_classes) if bool((y[a] == c).any())]
        for i, c in enumerate(present):
            grads = torch.autograd.grad(losses[c], params, retain_graph=i < len(present) - 1)
            row = torch.cat([g.flatten() for g in grads])
            out[a, c] = row if keep is None else row[keep]
    return out


def vmap_gradients(
    model: nn.Module, x: Tensor, y: Tensor, num_classes: int, keep: Tensor | None, chunk_size: int
) -> Tensor:
    """The library path (as in ``client_features``): vmap'd class-restricted gradients, then the kept coordinates."""
    grads = class_restricted_gradients(model, x, y, num_classes, chunk_size)
    return grads if keep is None else grads[:, :, keep]


def best_time(fn: Callable[[], Tensor], repeats: int) -> tuple[float, float, Tensor]:
    """One warm-up call, then the lowest wall and process-CPU seconds of ``repeats`` calls, and the result."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else lambda: None
    result = fn()
    wall, cpu = [], []
    for _ in range(repeats):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        result = fn()
        sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return min(wall), min(cpu), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--prune", action="store_true", help="keep the pruned DDI coordinates (fraction 0.01)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="e.g. cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # TF32 convolutions (cuDNN's default on Ampere and later) round batched and single-sample kernels
    # differently (~5e-2 apart on an H200); full float32 makes the vmap/loop check meaningful.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    model, x, y, num_classes = task_model_and_batch(args.batch, args.seed)
    model, x, y = model.to(args.device), x.to(args.device), y.to(args.device)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    keep = prune_indices(num_params, 0.01, args.seed).to(args.device) if args.prune else None
    present = torch.stack([(y == c).flatten(1).any(1) for c in range(num_classes)], dim=1)
    print(f"model: SegmentationClient unet width 16 depth 2 instance norm, {num_params} parameters, {num_classes} "
          "classes")  # fmt: skip
    print(f"batch: {len(x)} images {tuple(x.shape[1:])} of site0, {int(present.sum())} (sample, present class) pairs")
    print(f"gradient coordinates kept: {num_params if keep is None else len(keep)}; chunk size {args.chunk_size}; "
          f"{args.device}, {args.threads} torch thread(s); best of {args.repeats} after 1 warm-up")  # fmt: skip

    t_vmap, c_vmap, g_vmap = best_time(
        lambda: vmap_gradients(model, x, y, num_classes, keep, args.chunk_size), args.repeats
    )
    t_loop, c_loop, g_loop = best_time(lambda: loop_gradients(model, x, y, num_classes, keep), args.repeats)

    # Batched and single-sample convolutions round differently; where a ReLU input is within rounding of 0
    # the two paths may take different sides of the kink, so a rare row differs by more than float32 noise.
    diff, scale = (g_vmap - g_loop).abs().max().item(), g_loop.abs().max().item()
    rows = (g_vmap - g_loop)[present].norm(dim=-1) / g_loop[present].norm(dim=-1).clamp_min(1e-30)
    print(f"max |vmap - loop| = {diff:.2e} (max |grad| {scale:.2e}); relative row error: max {rows.max():.1e}, "
          f"median {rows.median():.1e}, rows above 1e-5: {int((rows > 1e-5).sum())} of {len(rows)}")  # fmt: skip
    torch.testing.assert_close(g_vmap, g_loop, atol=1e-3 * scale, rtol=1e-3)
    if not bool((g_vmap[~present] == 0).all()):
        raise AssertionError("vmap gradients of classes absent from a sample are not zero")

    print("wall clock (and in brackets process CPU time, which other processes on a shared machine barely disturb)")
    for name, wall, cpu in (("python loop", t_loop, c_loop), ("vmap", t_vmap, c_vmap)):
        print(f"{name:11s}: {wall * 1e3:8.1f} ms ({cpu * 1e3:8.1f} ms)   {wall / len(x) * 1e3:6.2f} ms/sample")
    ratio = t_loop / t_vmap
    verdict = "met" if ratio >= TARGET else "NOT met"
    print(f"speed-up loop/vmap: {ratio:.2f}x ({c_loop / c_vmap:.2f}x CPU time); target >= {TARGET:.0f}x: {verdict}")


if __name__ == "__main__":
    main()
