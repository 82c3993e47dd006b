"""`dsv41 bench decode`: end-to-end tokens/s through `dsv41.load` on a synthetic checkpoint in the
release format with the released expert sizes but two layers and eight routed experts (written by
the bench, or an existing one with --checkpoint), once with the earlier runtime's experts (each
routed expert expanded to BF16 per call, the shared expert held in BF16) and once fused (packed
routed experts, FP8 shared expert), with a per-phase table: attention, routed experts, shared
expert, Engram, head and the rest, and what the site registry costs a decode with nothing
registered (against the same decode with no registry at all). `--geometry released` instead
writes every released dimension (attention, vocabulary, FP32 head, experts) on a few layers and
reports, at one thread and at every core, each phase's seconds per token against the bytes it must
read and the copy bandwidth floor, and the 40-layer prediction (`bench_decode_released`).
`--speculative`: plain against speculative decoding on the same checkpoint (`speculative.py`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from dsv41.core.config import Config
from dsv41.generation.generate import decode_n, prefill
from dsv41.model.hooks import without_sites
from dsv41.model.moe import RoutedExperts

from . import released, speculative
from .common import DIM, INTER, TOPK, PhaseClock, on_synthetic_checkpoint, rss_bytes
from .experts import _baseline_expert, _expand_bf16

PHASES = ("attention", "routed experts", "shared expert", "Engram", "head")
REGISTRY_ROUNDS = 5  # decodes per arm of the registry's cost, the fastest kept


# ---------------------------------------------------------------------- bench decode
def decode_config(dim: int = DIM, inter: int = INTER):
    """The tiny preset reshaped for timing: the given expert sizes, 2 backbone layers (the second
    compresses, indexes and reads Engram) plus 1 MTP layer, 8 routed experts with 6 active."""
    from dsv41.checkpoint.inventory import derived_engram_rows
    from dsv41.checkpoint.tiny import tiny_config

    cfg = tiny_config().replace(
        dim=dim,
        moe_inter_dim=inter,
        n_layers=2,
        n_mtp_layers=1,
        compress_ratios=(0, 2, 0),
        kv_source_layers=(1,),
        index_source_layers=(1,),
        candidate_source_layer=1,
        engram_layer_ids=(1,),
        engram_num_embeddings=None,
        dspark_target_layer_ids=(1,),
        n_routed_experts=8,
        n_activated_experts=TOPK,
        dspark_n_routed_experts=6,
        dspark_n_activated_experts=2,
        vision_n_layers=0,
    )
    cfg = cfg.replace(engram_num_embeddings=derived_engram_rows(cfg))
    problems = cfg.verify()
    if problems:
        raise ValueError(f"the decode benchmark's config does not verify: {problems[0]}")
    return cfg


def write_decode_checkpoint(
    out_dir: str, dim: int = DIM, inter: int = INTER, seed: int = 0, *, cfg: Config | None = None
) -> str:
    """Write the decode benchmark's checkpoint (release layout, `decode_config`, or `cfg`) into
    out_dir with `synthetic.random_fill` values."""
    from dsv41.checkpoint.synthetic import random_fill, write_release_layout

    write_release_layout(out_dir, cfg if cfg is not None else decode_config(dim, inter), random_fill(seed))
    return out_dir


# ---------------------------------------------------------------------- the two forms of the experts
class _ExpandedExperts(RoutedExperts):
    """The earlier runtime's routed experts: fetched from the loader's cache, each selected
    expert then expanded to BF16 on every call."""

    def forward(self, x, expert_ids, weights):
        selected = torch.unique(expert_ids).tolist()
        fetched = dict(zip(selected, self.store.fetch(self.layer, selected)))
        y = torch.zeros(x.shape, dtype=torch.float32)
        for e in selected:
            rows, slot = torch.where(expert_ids == e)
            y.index_add_(
                0, rows, _baseline_expert(x[rows], fetched[e], self.swiglu_limit, weights[rows, slot, None]).float()
            )
        return y


def _shared_form(shared, fused: bool) -> Callable:
    """The shared expert fused from its FP8 bytes, or held dequantized to BF16 from load time on
    (the earlier runtime)."""
    from dsv41.kernels.experts import PackedExpert, clamped_swiglu, expert_ffn

    packed = PackedExpert(
        shared.w1.weight, shared.w1.scale, shared.w2.weight, shared.w2.scale, shared.w3.weight, shared.w3.scale
    )
    limit = shared.swiglu_limit
    if fused:
        return lambda x: expert_ffn(x, packed, limit)
    bf16 = PackedExpert(*(w for t, s in zip(packed[0::2], packed[1::2]) for w in (_expand_bf16(t, s), None)))

    def dense(x):
        h = clamped_swiglu(F.linear(x, bf16.w1), F.linear(x, bf16.w3), limit)
        return F.linear(h.to(x.dtype), bf16.w2)

    return dense


def _attach_forms(model, fused: bool) -> None:
    """Every layer's experts in the baseline's or the fused form (fused routed experts are the
    model's own), through `MoE.attach_store`."""
    for block in model.backbone.layers:
        moe = block.ffn
        moe.attach_store(
            moe.experts.store,
            routed=None if fused else _ExpandedExperts,
            shared=_shared_form(moe.shared_experts, fused),
        )


def bench_decode(
    checkpoint: str, *, prompt_tokens: int, decode_tokens: int, log: Callable[[str], None] = print
) -> dict:
    """Prefill then decode greedily, baseline then fused; tokens/s and per-phase seconds per token."""
    import dsv41
    from dsv41.kernels import native

    # threads=None: the bench's own --threads (default: torch's) governs, not the loader's "auto"
    model = dsv41.load(checkpoint, quiet=True, max_seq_len=prompt_tokens + decode_tokens + 8, threads=None)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    report = {
        "command": "bench decode",
        "checkpoint": checkpoint,
        "dim": cfg.dim,
        "inter": cfg.moe_inter_dim,
        "n_layers": cfg.n_layers,
        "n_experts": cfg.n_routed_experts,
        "topk": cfg.n_activated_experts,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "threads": torch.get_num_threads(),
        "fused_cpu_kernel": "native" if native.available() else "torch",
        "modes": {},
    }
    for mode in ("baseline", "fused"):
        clock = PhaseClock(PHASES)
        _attach_forms(model, mode == "fused")
        with clock.timing(model):
            prefill(model, prompt)  # warms the expert cache and the allocations
            began = time.perf_counter()
            logits = prefill(model, prompt)
            prefill_s = time.perf_counter() - began
            clock.reset()
            token = int(logits[0].argmax())
            began = time.perf_counter()
            tokens = decode_n(model, token, decode_tokens)
            decode_s = time.perf_counter() - began
        per_token = {phase: t / decode_tokens for phase, t in clock.seconds.items()}
        per_token["other"] = decode_s / decode_tokens - sum(per_token.values())
        report["modes"][mode] = {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "tokens_per_s": decode_tokens / decode_s,
            "phases_s_per_token": per_token,
            "tokens": tokens,
        }
    report["registry"] = _registry_cost(model, prompt, decode_tokens)
    base, fused = report["modes"]["baseline"], report["modes"]["fused"]
    report["speedup"] = fused["tokens_per_s"] / base["tokens_per_s"]
    report["same_tokens"] = base["tokens"] == fused["tokens"]
    log(
        f"{cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} routed experts ({cfg.n_activated_experts} "
        f"active) of inter {cfg.moe_inter_dim}; prompt {prompt_tokens} tokens, {decode_tokens} decoded; "
        f"fused experts on the {report['fused_cpu_kernel']} CPU kernel"
    )
    log(f"{'s per decoded token':<20} {'baseline':>10} {'fused':>10}")
    for phase in (*PHASES, "other"):
        log(f"{phase:<20} {base['phases_s_per_token'][phase]:>10.4f} {fused['phases_s_per_token'][phase]:>10.4f}")
    log(f"{'tokens/s':<20} {base['tokens_per_s']:>10.3f} {fused['tokens_per_s']:>10.3f}   ({report['speedup']:.1f}x)")
    log(f"{'prefill s':<20} {base['prefill_s']:>10.3f} {fused['prefill_s']:>10.3f}")
    registry = report["registry"]
    log(
        f"site registry, nothing registered: {registry['ratio']:.3f}x the decode time of a forward with no registry "
        f"({registry['with_registry_s']:.4f} s against {registry['without_registry_s']:.4f} s, fastest of "
        f"{registry['rounds']} rounds each, fused)"
    )
    report["end"] = rss_bytes()
    log(
        f"resident memory: {report['end']['rss_bytes'] / 2**20:.0f} MiB now, "
        f"{report['end']['peak_rss_bytes'] / 2**20:.0f} MiB peak"
    )
    return report


def _registry_cost(model, prompt: list[int], decode_tokens: int, rounds: int = REGISTRY_ROUNDS) -> dict:
    """Decode seconds with the site registry in place and nothing registered against the same
    decode with no registry at all (`hooks.without_sites`: every site lookup answers None), the
    rounds interleaved (each round in the other order than the last, so a drift in the machine's
    speed reaches both alike) and the fastest of each kept; the draft stack is off in both (the
    sites feed it), so the two differ by the registry alone."""
    best = {"with": math.inf, "without": math.inf}
    draft, feeds = model.draft_stack, model.backbone.feeds_draft
    model.draft_stack, model.backbone.feeds_draft = None, False
    try:
        for i in range(rounds):
            for arm in ("with", "without") if i % 2 == 0 else ("without", "with"):
                with without_sites(model.backbone) if arm == "without" else nullcontext():
                    token = int(prefill(model, prompt)[0].argmax())
                    began = time.perf_counter()
                    decode_n(model, token, decode_tokens)
                    best[arm] = min(best[arm], time.perf_counter() - began)
    finally:
        model.draft_stack, model.backbone.feeds_draft = draft, feeds
    return {
        "with_registry_s": best["with"],
        "without_registry_s": best["without"],
        "ratio": best["with"] / best["without"],
        "rounds": rounds,
    }


# ---------------------------------------------------------------------- the subcommand
def add_parser(sub) -> None:
    de = sub.add_parser("decode", help="end-to-end tokens/s and phases on a synthetic checkpoint, baseline vs fused")
    de.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="use this checkpoint; an empty or missing folder is "
        "filled with the synthetic one and kept (default: a temporary folder)",
    )
    de.add_argument("--tokens", type=int, default=4, help="tokens to decode (default 4)")
    de.add_argument("--prompt", type=int, default=8, help="prompt length (default 8)")
    de.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    de.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    de.add_argument("--dims", default=f"{DIM},{INTER}", help=argparse.SUPPRESS)
    de.add_argument(
        "--geometry",
        choices=("experts", "released"),
        default="experts",
        help="experts (default): the embedded attention with released expert sizes, baseline vs "
        "fused; released: every released dimension on a few layers, per phase against the "
        "bandwidth floor, at 1 thread and at every core, with the 40-layer prediction",
    )
    de.add_argument("--layers", type=int, default=2, help="backbone layers with --geometry released (default 2)")
    de.add_argument(
        "--experts", type=int, default=8, help="routed experts per layer with --geometry released (default 8)"
    )
    de.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds per thread setting with --geometry released, the fastest kept (default 2)",
    )
    de.add_argument(
        "--device",
        default="cpu",
        help="with --geometry released: cpu (default), or cuda / cuda:N "
        "to hold and run the routed experts there (dense layers on the host)",
    )
    de.add_argument(
        "--speculative",
        action="store_true",
        help="plain greedy decoding against speculative decoding with the draft stack and with a "
        "forced-acceptance draft source (the best case), on the experts geometry",
    )
    de.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # the released plan at tiny dims
    de.add_argument("--copy-mib", type=int, default=256, help=argparse.SUPPRESS)


def main(args) -> int:
    if args.tokens < 1 or args.prompt < 2:
        print("dsv41 bench: --tokens must be at least 1 and --prompt at least 2", file=sys.stderr)
        return 2
    if args.geometry == "released":
        if args.speculative:
            print("dsv41 bench: --speculative runs on the experts geometry; drop --geometry released", file=sys.stderr)
            return 2
        return released.main(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dim, inter = (int(v) for v in args.dims.split(","))
    bench = speculative.bench_speculative if args.speculative else bench_decode

    def write(path):
        write_decode_checkpoint(path, dim, inter)
        return "the synthetic checkpoint"

    return on_synthetic_checkpoint(
        args,
        "dsv41-bench-decode-",
        write,
        lambda path: bench(path, prompt_tokens=args.prompt, decode_tokens=args.tokens),
    )
