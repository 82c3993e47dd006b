"""Images in: the resize plan, loading and patching, the vision tower (ViT and aligner) and the
prompt that carries image spans.

An image becomes a grid of `vision_patch_size` pixel patches for the ViT (`vit_rows x vit_cols`)
and, after the aligner's `vision_downsample_ratio`-square merge, a grid of LLM cells
(`llm_rows x llm_cols`). The language model sees it as one span of positions,

    image start, then per row: llm_cols image cells and one row newline, then image end,

so a span takes `llm_rows * (llm_cols + 1) + 2` positions. Every position of a span carries
`image_token_id`; only the token type tells them apart (TEXT -1, IMAGE_START 0, IMAGE 1,
IMAGE_NEWLINE 2, IMAGE_END 3, the released numbering). After the embedding the image cells take
the aligner rows in reading order and the delimiters take the learned `image_start`,
`image_newline` and `image_end` vectors; inside a span the router selects experts with `bias_vl`
and the Engram skips the positions (no n-gram reaches across them, no update lands on them).

`plan(width, height, cfg)` is the whole resize decision as a pure function: the minimum-pixel
upscale, the optional width/height cap, rounding up to whole patches and the shrink that keeps the
span within `vision_max_n_token` positions. `load_image` takes a path, bytes or a PIL image and
says in one sentence what is wrong with a bad one. The tower runs in bf16, as the released runtime
holds it, with float32 norm weights and rotary tables.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RMSNorm, param

TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3
# The vision tower's RMSNorm epsilon (the language model's norm_eps does not reach it).
VISION_NORM_EPS = 1e-6
# Letterbox fill around a padded image: mid grey, which normalizes to (almost) zero.
PAD_GREY = (127, 127, 127)


class ImageError(ValueError):
    """An image that cannot be used; the message is one sentence naming the input."""


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class VisionPlan:
    """What an image of `width x height` pixels becomes: the pixel size it is brought to (stretched
    when `stretch`, else scaled to fit and padded grey), the ViT patch grid and the LLM cell grid."""

    width: int
    height: int
    pixel_width: int
    pixel_height: int
    vit_rows: int
    vit_cols: int
    llm_rows: int
    llm_cols: int
    stretch: bool

    @property
    def patches(self) -> int:
        return self.vit_rows * self.vit_cols

    @property
    def cells(self) -> int:
        """Aligner rows: the span's IMAGE positions."""
        return self.llm_rows * self.llm_cols

    @property
    def span_tokens(self) -> int:
        return span_length(self.llm_rows, self.llm_cols)

    def token_types(self) -> list[int]:
        """The span's token types in sequence order."""
        row = [IMAGE] * self.llm_cols + [IMAGE_NEWLINE]
        return [IMAGE_START] + row * self.llm_rows + [IMAGE_END]


def span_length(llm_rows: int, llm_cols: int) -> int:
    return llm_rows * (llm_cols + 1) + 2


def _llm_grid(pixel_height: int, pixel_width: int, patch: int, ratio: int) -> tuple[int, int]:
    # whole patches, then ceil over the merge: a partial merge block is zero-padded by the aligner
    return math.ceil((pixel_height // patch) / ratio), math.ceil((pixel_width // patch) / ratio)


def _fit_budget(height, width, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest pixel size of this aspect whose span fits `max_tokens`: the cell counts solve
    rows * (cols + 1) + 2 = max_tokens with rows = cols * height / width; an aspect too extreme for
    one cell on the short side collapses to a single column (or row) as long as the budget allows."""
    aspect = height / width
    cols = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    cell = patch * ratio
    if cols < 1.0:
        return (max_tokens - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def plan(width: int, height: int, cfg) -> VisionPlan:
    """The resize plan for an image of `width x height` pixels under `cfg` (a pure function)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (width, height)):
        raise ImageError(f"an image size is two whole numbers of pixels, got {width!r} x {height!r}")
    if width < 1 or height < 1:
        raise ImageError(f"an image of {width} x {height} pixels has zero size")
    if not cfg.vision_n_layers:
        raise ImageError("this model's config has no vision tower (vision_n_layers is 0), so it takes no images")
    patch, ratio, budget = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    max_wh = cfg.vision_max_wh_ratio
    w, h = width, height
    if max_wh is not None and w > h * max_wh:
        w = h * max_wh
    if w * h < cfg.vision_min_pixels:
        up = (cfg.vision_min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    pixel_w, pixel_h = math.ceil(w / patch) * patch, math.ceil(h / patch) * patch
    rows, cols = _llm_grid(pixel_h, pixel_w, patch, ratio)
    if span_length(rows, cols) > budget:
        pixel_h, pixel_w = _fit_budget(h, w, patch, ratio, budget)
        rows, cols = _llm_grid(pixel_h, pixel_w, patch, ratio)
    return VisionPlan(width, height, int(pixel_w), int(pixel_h), int(pixel_h) // patch, int(pixel_w) // patch,
                      rows, cols, stretch=max_wh is not None and width >= max_wh * height)


# ---------------------------------------------------------------------- loading
def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"the image bytes ({len(source):,} bytes)"
    return "the PIL image"


def load_image(source):
    """A path, bytes or a PIL image -> an RGB PIL image (a copy; the source is left as it was).
    Anything unusable raises ImageError with one sentence naming the input."""
    from PIL import Image, UnidentifiedImageError

    name = _describe(source)
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise ImageError(f"{name}: no such image file")
        opener = lambda: Image.open(os.fspath(source))  # noqa: E731
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        opener = lambda: Image.open(io.BytesIO(data))  # noqa: E731
    elif isinstance(source, Image.Image):
        opener = None
    else:
        raise ImageError(f"an image is a file path, bytes or a PIL image, got {type(source).__name__}")
    try:
        if opener is None:
            image = _to_rgb(source, name)
        else:
            with opener() as opened:
                opened.load()  # decode now: a truncated file fails here, not later in a resize
                image = _to_rgb(opened, name)
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise ImageError(f"{name}: more pixels than Pillow's decompression-bomb limit "
                         f"({Image.MAX_IMAGE_PIXELS:,} pixels) allows; shrink it first") from None
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image file Pillow can read") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's truncated / damaged data
        raise ImageError(f"{name}: the image data is truncated or damaged ({_first_line(exc)})") from None
    return image


def _to_rgb(image, name: str):
    if image.width < 1 or image.height < 1:
        raise ImageError(f"{name}: the image has zero size ({image.width} x {image.height} pixels)")
    try:
        return image.convert("RGB")
    except (ValueError, OSError) as exc:
        raise ImageError(f"{name}: its mode {image.mode} cannot be converted to RGB ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


def patchify(image, cfg) -> tuple[VisionPlan, torch.Tensor]:
    """An RGB PIL image -> (its plan, bf16 patches [vit_rows * vit_cols, 3, p, p] in row-major order).

    The image is stretched to the plan's pixel size when `plan.stretch`, else scaled to fit and
    centred on grey; pixels go to [-1, 1] in float32 and are rounded to bf16 once."""
    import numpy as np
    from PIL import ImageOps

    p = cfg.vision_patch_size
    shape = plan(image.width, image.height, cfg)
    size = (shape.pixel_width, shape.pixel_height)
    framed = image.resize(size) if shape.stretch else ImageOps.pad(image, size, color=PAD_GREY)
    pixels = torch.from_numpy(np.asarray(framed, dtype=np.float32)).permute(2, 0, 1) / 255  # [3, H, W]
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16)
    patches = pixels.reshape(3, shape.vit_rows, p, shape.vit_cols, p)  # [3, rows, p, cols, p]
    patches = patches.permute(1, 3, 0, 2, 4).reshape(shape.patches, 3, p, p)  # [rows * cols, 3, p, p]
    return shape, patches


# ---------------------------------------------------------------------- the prompt
@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: where its span starts (an offset into the prompt; negative in a
    slice that begins inside the span), its plan and patches, and once encoded the aligner rows."""

    start: int
    plan: VisionPlan
    patches: torch.Tensor  # bf16 [n_patches, 3, p, p]
    features: Optional[torch.Tensor] = None  # [plan.cells, dim], set by Model.encode_images

    @property
    def length(self) -> int:
        return self.plan.span_tokens


@dataclass(frozen=True)
class Prompt:
    """Token ids with image spans: `ids` (every span position carries image_token_id),
    `token_types` (TEXT or a span type per position) and `images` in order of their spans.
    A model call takes a Prompt wherever it takes ids; slicing keeps the images that overlap."""

    ids: list
    token_types: list
    images: tuple = ()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def image_positions(self) -> int:
        return sum(1 for t in self.token_types if t != TEXT)

    def image_mask(self) -> torch.Tensor:
        """bool [1, n]: True inside an image span."""
        return torch.tensor([[t != TEXT for t in self.token_types]], dtype=torch.bool)

    def __getitem__(self, index) -> "Prompt":
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a Prompt is sliced with [start:stop]")
        lo, hi, _ = index.indices(len(self.ids))
        hi = max(lo, hi)
        kept = tuple(dataclasses.replace(img, start=img.start - lo) for img in self.images
                     if img.start < hi and img.start + img.length > lo)
        return Prompt(self.ids[lo:hi], self.token_types[lo:hi], kept)

    def extend(self, ids: Sequence[int]) -> "Prompt":
        """This prompt followed by text tokens (a continuation)."""
        ids = [int(i) for i in ids]
        return Prompt(self.ids + ids, self.token_types + [TEXT] * len(ids), self.images)


def prepare(cfg, ids: Sequence[int], images: Sequence = (), *, insert_at: int = 0) -> Prompt:
    """Token ids with image placeholders -> a Prompt: each `image_token_id` in `ids` becomes the
    span of the next image. Without any placeholder the images go first (at `insert_at`, after a
    BOS); any other count that differs from the number of images is an error."""
    ids = [int(i) for i in ids]
    images = list(images)
    marker = cfg.image_token_id
    markers = sum(1 for i in ids if i == marker)
    if images and not cfg.vision_n_layers:
        raise ImageError("this model's config has no vision tower (vision_n_layers is 0), so it takes no images")
    if images and markers == 0:
        ids = ids[:insert_at] + [marker] * len(images) + ids[insert_at:]
        markers = len(images)
    if markers != len(images):
        raise ImageError(f"the prompt marks {markers} image place{'s' if markers != 1 else ''} "
                         f"(token {marker}) but {len(images)} image{'s were' if len(images) != 1 else ' was'} given")
    loaded = [patchify(load_image(source), cfg) for source in images]  # every image read before any is used
    out_ids, types, inputs = [], [], []
    pending = iter(loaded)
    for token in ids:
        if token != marker:
            out_ids.append(token)
            types.append(TEXT)
            continue
        shape, patches = next(pending)
        inputs.append(ImageInput(len(out_ids), shape, patches))
        span = shape.token_types()
        out_ids += [marker] * len(span)
        types += span
    return Prompt(out_ids, types, tuple(inputs))


# ---------------------------------------------------------------------- the tower
class DenseLinear(nn.Module):
    """y = x W^T (+ b) in the weight's dtype (bf16 here): the tower's projections are unquantized."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = param(torch.zeros(out_features, in_features, dtype=dtype))
        self.bias = param(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _random_init_(self, gen: torch.Generator) -> None:
        w = torch.randn(self.out_features, self.in_features, generator=gen) / math.sqrt(self.in_features)
        self.weight.copy_(w.to(self.weight.dtype))
        if self.bias is not None:
            self.bias.copy_((torch.randn(self.out_features, generator=gen) * 0.02).to(self.bias.dtype))


def rotary_2d(rows: int, cols: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) [rows * cols, 1, dim] for patches in row-major order: the first dim / 2
    angles turn with the patch's row, the last dim / 2 with its column."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim / 2]
    row = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    col = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    angles = torch.stack([row, col], dim=-1).reshape(-1, 2, 1).float() * inv_freq  # [n, 2, dim / 2]
    angles = angles.flatten(1)  # [n, dim]
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, d] by pairing its first and second halves (not adjacent elements, as the
    language model's RoPE does), in float32, back in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wqkv = DenseLinear(dim, 3 * dim)
        self.wo = DenseLinear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))  # [n, h, d]
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        # every patch sees every patch of its image: no mask
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [h, n, d]
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with the gate and up projections fused in `w1` (gate first)."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = DenseLinear(dim, 2 * inter_dim, bias=False)
        self.w2 = DenseLinear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, dtype=torch.float32)
        self.attn = VisionAttention(cfg.vision_dim, cfg.vision_n_heads)
        self.norm2 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, dtype=torch.float32)
        self.mlp = VisionMLP(cfg.vision_dim, cfg.vision_inter_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """The vision encoder `vision.*`: patch embedding, pre-norm blocks with bidirectional attention
    and 2D rotary embeddings over half of each head, a final norm. bf16 weights, float32 norms."""

    def __init__(self, cfg):
        super().__init__()
        self.rope_dim = cfg.vision_dim // cfg.vision_n_heads // 2
        self.rope_theta = float(cfg.vision_rope_theta or 10000.0)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = DenseLinear(3 * cfg.vision_patch_size ** 2, cfg.vision_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_n_layers))
        self.norm = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, dtype=torch.float32)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """bf16 patches [rows * cols, 3, p, p] -> [rows * cols, vision_dim]."""
        x = self.patch_embed.proj(patches.flatten(1))  # [n, 3 p p] -> [n, vision_dim]
        cos, sin = (t.to(x.device) for t in rotary_2d(rows, cols, self.rope_dim, self.rope_theta))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """`aligner.*`: each ratio x ratio block of ViT outputs (zero-padded at the right and bottom
    edges) concatenated channel-major, then two linears with a GELU between, to the model dim."""

    def __init__(self, cfg):
        super().__init__()
        self.ratio = cfg.vision_downsample_ratio
        self.w1 = DenseLinear(cfg.vision_dim * self.ratio ** 2, cfg.dim)
        self.w2 = DenseLinear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, vision_dim] -> [ceil(rows / r) * ceil(cols / r), dim], cells row-major."""
        r = self.ratio
        grid = x.view(rows, cols, -1).permute(2, 0, 1)  # [C, rows, cols]
        grid = F.pad(grid, (0, -cols % r, 0, -rows % r))
        blocks = F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)  # [cells, C r r]
        return self.w2(F.gelu(self.w1(blocks)))


def encode_image(vit: ViT, aligner: Aligner, image: ImageInput) -> torch.Tensor:
    """The aligner rows [cells, dim] of one image."""
    rows, cols = image.plan.vit_rows, image.plan.vit_cols
    device = next(vit.parameters()).device
    return aligner(vit(image.patches.to(device), rows, cols), rows, cols)


def write_spans(h: torch.Tensor, images: Sequence[ImageInput], delimiters: dict[int, torch.Tensor]) -> None:
    """Overwrite the span positions of h [1, s, dim] in place: image cells take each image's
    `features`, the delimiters their learned vectors ({IMAGE_START: v, IMAGE_NEWLINE: v,
    IMAGE_END: v}). A span that starts before or ends after this call is cut to the call."""
    seqlen = h.size(1)
    for image in images:
        types = torch.tensor(image.plan.token_types())
        span = h.new_empty(len(types), h.size(-1))  # [span, dim]
        for kind, vector in delimiters.items():
            span[types == kind] = vector.to(h.dtype)
        span[types == IMAGE] = image.features.to(h.device, h.dtype)
        lo, hi = max(0, -image.start), min(len(types), seqlen - image.start)
        h[0, image.start + lo : image.start + hi] = span[lo:hi]
