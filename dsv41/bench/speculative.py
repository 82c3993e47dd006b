"""`dsv41 bench decode --speculative`: plain greedy decoding against speculative decoding with the
checkpoint's draft stack and with a forced-acceptance draft source, on one model in one run."""

from __future__ import annotations

from typing import Callable

import torch


def bench_speculative(
    checkpoint: str, *, prompt_tokens: int, decode_tokens: int, log: Callable[[str], None] = print
) -> dict:
    """Greedy decoding three ways on one model, in one run: plain (one forward per token), speculative
    with the checkpoint's draft stack, and speculative with a forced-acceptance draft source that
    proposes plain decoding's own continuation (every proposal right: the best case, labelled so).
    Tokens/s, target forwards per token, and whether each produced plain decoding's tokens."""
    import dsv41
    from dsv41.core.numerics import Numerics
    from dsv41.generation.generate import generate

    # parity numerics: a verify and one-token steps are the same arithmetic, so the tokens must agree
    model = dsv41.load(
        checkpoint, quiet=True, max_seq_len=prompt_tokens + decode_tokens + 8, threads=None, numerics=Numerics.parity()
    )
    if model.draft_stack is None:
        raise ValueError(f"{checkpoint} has no DSpark draft stack (mtp.* stages with dspark_block_size > 0)")
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    n = decode_tokens + 1  # the first token comes from the prefill

    generate(model, prompt, max_new_tokens=2, stop_at_eos=False)  # warms the caches and allocations
    plain = generate(model, prompt, max_new_tokens=n, stop_at_eos=False)
    everything = plain.prompt_ids + plain.ids

    def forced(m, anchor, k):
        start = m.position
        return everything[start + 1 : start + 1 + k], [20.0] * k

    runs = {
        "plain": plain,
        "speculative (draft stack)": generate(
            model, prompt, max_new_tokens=n, stop_at_eos=False, speculative=True, min_confidence=0.0
        ),
        "speculative (forced acceptance: best case)": generate(
            model, prompt, max_new_tokens=n, stop_at_eos=False, speculative=True, draft_source=forced
        ),
    }
    report = {
        "command": "bench decode --speculative",
        "checkpoint": checkpoint,
        "dim": cfg.dim,
        "n_layers": cfg.n_layers,
        "draft_block": cfg.dspark_block_size,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "threads": torch.get_num_threads(),
        "numerics": "parity",
        "runs": {},
    }
    log(
        f"{cfg.n_layers} layers, dim {cfg.dim}, draft block {cfg.dspark_block_size}; prompt {prompt_tokens} tokens, "
        f"{decode_tokens} decoded greedily; numerics parity (speculation must give plain decoding's tokens)"
    )
    log(f"{'run':<44} {'tokens/s':>9} {'forwards/token':>15} {'same tokens':>12}")
    for name, r in runs.items():
        spec = r.speculation
        forwards = spec.target_forwards if spec is not None else len(r.ids) - 1
        row = {
            "tokens_per_s": r.timings["tokens_per_s"],
            "target_forwards": forwards,
            "forwards_per_token": forwards / (len(r.ids) - 1),
            "same_tokens": r.ids == plain.ids,
            "mean_accepted": None if spec is None else spec.mean_accepted,
        }
        report["runs"][name] = row
        log(f"{name:<44} {row['tokens_per_s']:>9.2f} {row['forwards_per_token']:>15.2f} {str(row['same_tokens']):>12}")
    base = report["runs"]["plain"]["tokens_per_s"]
    report["speedup"] = {name: row["tokens_per_s"] / base for name, row in report["runs"].items()}
    log("tokens/s against plain: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["speedup"].items() if k != "plain"))
    return report


# ---------------------------------------------------------------------- bench decode --geometry released
