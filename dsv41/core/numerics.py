"""Where dsv41's arithmetic may knowingly depart from the released runtime's: one frozen value.

`Numerics()` (the default everywhere) does what the released runtime does.
`Numerics.parity()` is the set under which a prefill, the same tokens decoded one at a time and
any split of them into chunks agree bit for bit:

- window_layout "uniform": every query lists its window rows the same way in a prefill and a
  decode step (`attention.window_rows`); the reference's decode lists the ring with its empty
  slots first, which regroups sparse_attn's 64-column sums.
- pad_f32_rows: the float32 GEMMs (router, hyper-connection mixes, head, compressor pooling) and
  the bf16 grouped output projection run as GEMMs of exactly 8 rows (the last zero-padded) so CPU
  BLAS takes one kernel for any row count (`layers.in_row_blocks`), and routed experts run
  batch-invariant (`kernels.experts`).

- tie_break "lowest": equal scores in the indexer's top-k and the candidate-block cut go to the
  lower position (`attention.top_k`); torch.topk's own order (the reference's) follows memory
  layout, so a prefill row and a decode row could keep different members of a tie. With one tie
  rule the selections cannot differ, so the equality holds at every position, not only until
  the first tie.

- summation "fast" (never part of parity, never the default): the order training sums in where a
  forward runs over float32 master weights (`dsv41 train`): the hyper-connection collapse and
  expansion as one batched product each, attention as one dense product under a mask of the rows
  each query reads (`kernels.masked_attention`), products whose inference form is bf16 computed in
  float32 and rounded to bf16 after, the routed experts one float32 product per expert. The same
  values up to float32 rounding, several times faster to differentiate; "reference" sums as the
  released runtime does, so a forward over master weights on their storage grid gives the loaded
  checkpoint's logits bit for bit.

- fix_stale_index_keys: the Transformers port's fix for stale indexer keys (`attention.Indexer`).
  The reference republishes a Full layer's index keys only on calls that complete one of its
  groups, so what a layer scores depends on how the sequence was split into calls; with the fix
  every order scores the same keys. It changes what is computed, not only how it rounds, which
  is why it is a field of its own; `parity()` needs it.

Standard library only: the header-only commands import it without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# The index-row layouts `attention.window_rows` knows; the first is the released runtime's.
WINDOW_LAYOUTS = ("reference", "uniform")
# How `attention.top_k` orders equal scores; the first is the released runtime's (torch.topk).
TIE_BREAKS = ("topk", "lowest")
# How sums over master weights are ordered; the first is the released runtime's.
SUMMATIONS = ("reference", "fast")


@dataclass(frozen=True)
class Numerics:
    fix_stale_index_keys: bool = False
    window_layout: str = "reference"
    pad_f32_rows: bool = False
    tie_break: str = "topk"
    summation: str = "reference"

    def __post_init__(self):
        if self.window_layout not in WINDOW_LAYOUTS:
            raise ValueError(
                f"window_layout must be one of {', '.join(map(repr, WINDOW_LAYOUTS))}, got {self.window_layout!r}"
            )
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"tie_break must be one of {', '.join(map(repr, TIE_BREAKS))}, got {self.tie_break!r}")
        if self.summation not in SUMMATIONS:
            raise ValueError(f"summation must be one of {', '.join(map(repr, SUMMATIONS))}, got {self.summation!r}")
        for name in ("fix_stale_index_keys", "pad_f32_rows"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def parity(cls) -> "Numerics":
        return cls(fix_stale_index_keys=True, window_layout="uniform", pad_f32_rows=True, tie_break="lowest")

    @classmethod
    def named(cls, name: str) -> "Numerics":
        """ "reference" or "parity" (the CLI's --numerics)."""
        presets = {"reference": cls, "parity": cls.parity}
        if name not in presets:
            raise ValueError(f"numerics must be one of {', '.join(map(repr, presets))}, got {name!r}")
        return presets[name]()

    def with_options(self, **changes) -> "Numerics":
        """A copy with the given fields changed; a None value keeps the field."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)
