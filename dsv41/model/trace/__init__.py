"""What a forward records when asked, as plain data, and the file a generation's record is kept in.

`records.py`: the records observers fill from a forward's named sites (`Trace`, `ForwardTrace`,
`AttentionRecord`, `RoutingRecord`, `EngramRecord`, `FiniteRecord`, `StepRecord`) and the recorder
that fills them. `generation.py`: `GenerationTrace`, what a traced `generate` run returns, with
`save` / `GenerationTrace.load`. `file.py`: that file, an NPZ archive of plain arrays and a JSON
manifest, never pickle, every field checked when read (`TraceFileError`). The imports go one way:
records, then the file, then the generation trace. Nothing here imports model code.
"""

from .file import MAX_MANIFEST_BYTES, MAX_TRACE_BYTES, TRACE_FORMAT, TRACE_VERSION, TraceFileError
from .generation import GenerationTrace
from .records import AttentionRecord, EngramRecord, FiniteRecord, ForwardTrace, RoutingRecord, StepRecord, Trace

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_TRACE_BYTES",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "AttentionRecord",
    "EngramRecord",
    "FiniteRecord",
    "ForwardTrace",
    "GenerationTrace",
    "RoutingRecord",
    "StepRecord",
    "Trace",
    "TraceFileError",
]
