"""Where dsv41's arithmetic may knowingly depart from the released runtime's: one frozen value.

`Numerics.reference()` (the default everywhere) does what the released runtime does.
`Numerics.parity()` is the set under which a prefill and the same tokens decoded one at a time
agree bit for bit until some top-k has to cut between equal or rounding-close scores:

- window_layout "uniform": every query lists its window rows the same way in a prefill and a
  decode step (`attention.window_rows`); the reference's decode lists the ring with its empty
  slots first, which regroups sparse_attn's 64-column sums.
- pad_f32_rows: the float32 GEMMs (router, hyper-connection mixes, head, compressor pooling) pad
  their row count to a multiple of 8 so CPU BLAS takes one kernel for any row count
  (`layers.f32_linear`), and routed experts run batch-invariant (`kernels.experts`).

fix_stale_index_keys is the Transformers port's fix for stale indexer keys (`attention.Indexer`);
it changes what is computed, not how it rounds, so `parity()` leaves it off.

Standard library only: the header-only commands import it without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# The index-row layouts `attention.window_rows` knows; the first is the released runtime's.
WINDOW_LAYOUTS = ("reference", "uniform")


@dataclass(frozen=True)
class Numerics:
    fix_stale_index_keys: bool = False
    window_layout: str = "reference"
    pad_f32_rows: bool = False

    def __post_init__(self):
        if self.window_layout not in WINDOW_LAYOUTS:
            raise ValueError(f"window_layout must be one of {', '.join(map(repr, WINDOW_LAYOUTS))}, "
                             f"got {self.window_layout!r}")
        for name in ("fix_stale_index_keys", "pad_f32_rows"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def reference(cls) -> "Numerics":
        return cls()

    @classmethod
    def parity(cls) -> "Numerics":
        return cls(window_layout="uniform", pad_f32_rows=True)

    @classmethod
    def named(cls, name: str) -> "Numerics":
        """"reference" or "parity" (the CLI's --numerics)."""
        presets = {"reference": cls.reference, "parity": cls.parity}
        if name not in presets:
            raise ValueError(f"numerics must be one of {', '.join(map(repr, presets))}, got {name!r}")
        return presets[name]()

    def with_options(self, **changes) -> "Numerics":
        """A copy with the given fields changed; a None value keeps the field."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)
