"""CSA2 attention: compressor, indexer, candidate blocks, the attention layer and its modes.

Every layer attends, in one `sparse_attn` call, over a sliding window of its own raw KV and, when
its compress ratio is non-zero, over `index_topk` compressed positions picked by an indexer. Who
produces what is the layer's mode (`Config.layer_mode`):

- full     owns the Compressor (writes compressed KV) and `indexer.wk` (writes index keys),
           runs its indexer and publishes KV, index keys and its top-k;
- reindex  has its own indexer queries (`indexer.wq_b`) and re-ranks against the published keys,
           inside the candidate blocks when a candidate source precedes it; publishes its top-k;
- reuse    reads the compressed KV and top-k the last source published (pure window layers,
           ratio 0, are also 'reuse' and read nothing).

What a layer publishes goes into an `AttentionRuntime` passed to every forward, one per stack,
so two stacks in a process never share state. Arithmetic, dtypes, quantization points and the
index rows handed to `sparse_attn` follow the released reference runtime (`inference/model.py`);
departures are named where they occur: one rank only, an explicit runtime, `reset_state`, and
the `Numerics` a layer is built with (`dsv41.core.numerics`; the reference's arithmetic by default):
its `fix_stale_index_keys` is read by the indexer, `window_layout` by `window_rows`, and
`pad_f32_rows` by the compressor's float32 projections.

A call takes any number of tokens at the sequence's next position: a prefill at 0, one token per
decode step, or a chunk of several (the reference has no chunked prefill; its window rows and
compressor groups are those of a one-shot prefill, see `window_rows` and `Compressor`).

The caches hold what the trained model's quantization produces (`QuantizedCache`): with
`cache_format="packed"` (the default) the bytes the model card counts, the window ring as FP8 E4M3
with one E8M0 scale per 32 channels, compressed KV as two FP4 E2M1 codes a byte with one E4M3 scale
per 16, index keys as FP4 with one E8M0 scale per 32, decoded when read; with "bf16" the same
values already rounded to those grids, held in the activation dtype. A read decodes to exactly the
values the quantizer's in-place form writes, so the two formats give bit-identical outputs;
`cache_bytes` measures what either allocates. Packed, a layer decodes only the compressed rows its
queries selected (`Attention._compressed_rows`, which renumbers the selections into those rows),
so a decode step decodes index_topk rows, not the whole context.

The package: `caches` (encodings, `QuantizedCache`, the byte model), `runtime` (`AttentionRuntime`),
`compressor`, `indexer` (top-k and candidate blocks), `layer` (`window_rows`, `Attention`) and
`state` (the rows a call may overwrite, as typed records, and putting them back).
"""

from .caches import (
    CACHE_FORMATS,
    CACHE_PARTS,
    COMPRESSED_ENCODING,
    COMPRESSED_KV,
    COMPRESSOR_TAILS,
    ENCODINGS,
    HOLDING,
    INDEX_FP4_BLOCK,
    INDEX_KEY_ENCODING,
    INDEX_KEYS,
    KV_FP4_BLOCK,
    LONG_TERM,
    WINDOW_ENCODING,
    WINDOW_FP8_BLOCK,
    WINDOW_RING,
    CacheBytes,
    CacheEncoding,
    KVCacheBytes,
    QuantizedCache,
    RowLayout,
    SourceBytes,
    cache_bytes,
    check_cache_format,
    kv_cache_bytes,
)
from .compressor import Compressor
from .indexer import Indexer, attention_target, candidate_block_scores, select_candidate_blocks, top_k
from .layer import Attention, window_rows
from .runtime import AttentionRuntime, Published
from .state import CompressorTail, LayerRows, StackRows
