"""Benchmarks, one module per `dsv41 bench` subcommand: `experts` (the fused expert path against
expanding to BF16, on CPU, GPU or across ranks), `decode` (end-to-end on a synthetic checkpoint,
baseline against fused, per phase), `released` (`decode --geometry released`: every released
dimension against the bandwidth floor), `speculative` (`decode --speculative`), `prefill`,
`threads`, `vision` and `stream` (routed experts from disk under a memory budget); `common` holds
what they share (the one phase clock, best-of timing, the copy bandwidth, the command-line
plumbing). Ratios, not absolute times, are what they report: the machine may be shared."""

from .cli import cli_main
from .common import (
    DIM,
    INTER,
    PHASE_SITES,
    SWIGLU_LIMIT,
    TOPK,
    PhaseClock,
    best_time,
    best_times,
    copy_bandwidth,
    read_bandwidth,
    rss_bytes,
    token_list,
)
from .decode import PHASES, REGISTRY_ROUNDS, bench_decode, decode_config, write_decode_checkpoint
from .experts import (
    TARGETS,
    baseline_moe,
    bench_experts,
    bench_experts_gpu,
    bench_experts_parallel,
    expand_experts,
    expanded_moe,
    fused_moe,
    kernel_path,
    make_experts,
    make_routing,
    packed_bytes_read,
)
from .prefill import bench_prefill
from .released import (
    RELEASED_PHASES,
    bench_decode_released,
    decode_token_bytes,
    predict_released,
    released_decode_config,
)
from .speculative import bench_speculative
from .stream import bench_stream
from .threads import bench_threads
from .vision import bench_vision
