"""`dsv41 bench vision`: one image through the vision tower (ViT and aligner, bf16) at the released
geometry on synthetic weights: the resize plan, the seconds and the tower's weight bytes."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import torch

from .common import best_time, write_report


def bench_vision(
    width: int,
    height: int,
    *,
    blocks: Optional[int] = None,
    repeats: int = 1,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> dict:
    """One image's vision tower (ViT and aligner, bf16 as the released runtime holds them) at the
    released geometry on synthetic weights: the resize plan of a `width x height` image, the seconds
    of the best of `repeats` runs and the tower's weight bytes. `blocks` overrides the 32 ViT blocks."""
    from dsv41.core.config import RELEASED
    from dsv41.model import vision
    from dsv41.model.layers import init_random_

    cfg = RELEASED if blocks is None else RELEASED.replace(vision_n_layers=int(blocks))
    plan = vision.plan(width, height, cfg)
    vit, aligner = init_random_(vision.ViT(cfg), 0).to(device), init_random_(vision.Aligner(cfg), 1).to(device)
    g = torch.Generator().manual_seed(2)
    patches = torch.rand(plan.patches, 3, cfg.vision_patch_size, cfg.vision_patch_size, generator=g) * 2 - 1
    image = vision.ImageInput(0, plan, patches.to(torch.bfloat16))

    def run():
        with torch.inference_mode():
            out = vision.encode_image(vit, aligner, image)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        return out

    run()  # warm-up: allocator, kernels
    seconds = best_time(run, repeats, budget_s=600.0)
    weight_bytes = sum(p.numel() * p.element_size() for m in (vit, aligner) for p in m.parameters())
    report = {
        "width": width,
        "height": height,
        "pixel_size": [plan.pixel_width, plan.pixel_height],
        "vit_grid": [plan.vit_rows, plan.vit_cols],
        "patches": plan.patches,
        "llm_grid": [plan.llm_rows, plan.llm_cols],
        "span_tokens": plan.span_tokens,
        "vit_blocks": cfg.vision_n_layers,
        "vision_dim": cfg.vision_dim,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "weight_bytes": weight_bytes,
    }
    log(
        f"vision tower, {cfg.vision_n_layers} blocks of dim {cfg.vision_dim} ({weight_bytes / 2**30:.2f} GiB bf16): "
        f"a {width}x{height} image -> {plan.pixel_width}x{plan.pixel_height} px, {plan.patches:,} patches "
        f"({plan.vit_rows}x{plan.vit_cols}) -> {plan.cells} cells ({plan.llm_rows}x{plan.llm_cols}), "
        f"{plan.span_tokens} span tokens: {seconds:.2f} s on {device} ({torch.get_num_threads()} threads)"
    )
    return report


# ---------------------------------------------------------------------- the subcommand
def add_parser(sub) -> None:
    vi = sub.add_parser("vision", help="one image through the vision tower (ViT and aligner) at the released geometry")
    vi.add_argument(
        "--size",
        default="1344x1344",
        metavar="WxH",
        help="the image's pixel size before the resize plan (default 1344x1344: the full token budget)",
    )
    vi.add_argument("--repeats", type=int, default=1, help="runs, best kept (default 1)")
    vi.add_argument("--device", default="cpu", help="cpu (default) or a CUDA device")
    vi.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    vi.add_argument("--blocks", type=int, default=None, help=argparse.SUPPRESS)  # fewer ViT blocks, for tests


def main(args) -> int:
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
        if args.repeats < 1 or (args.blocks is not None and args.blocks < 1):
            raise ValueError("--repeats (and --blocks) must be at least 1")
        if args.device != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is available here")
        report = bench_vision(width, height, blocks=args.blocks, repeats=args.repeats, device=args.device)
    except ValueError as exc:  # a malformed --size, an image size the plan refuses (ImageError)
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_report(args.json, report)
    return 0
