"""Index (1, only with an index): each local shard holds exactly the tensors the index assigns it."""

from __future__ import annotations

from collections import defaultdict

from dsv41.checkpoint.audit.evidence import registry, verdict
from dsv41.checkpoint.audit.report import FAIL

CHECKS, check = registry("Index")


@check("index.shards", "every local shard holds exactly the tensors the index assigns it", needs_index=True)
def _shards(ctx):
    if ctx.index_problem:
        return FAIL, ctx.index_problem
    ev = ctx.ev
    assigned: dict[str, set[str]] = defaultdict(set)
    for name, shard in ev.index_map.items():
        assigned[shard].add(name)
    held: dict[str, set[str]] = defaultdict(set)
    for name, (_, shard, _) in ev.headers.items():
        held[shard].add(name)
    problems = []
    for shard in sorted(held):
        if shard not in assigned:
            problems.append(f"{shard} is not named in the index but holds {len(held[shard])} tensors")
            continue
        missing, extra = assigned[shard] - held[shard], held[shard] - assigned[shard]
        if missing:
            problems.append(f"{shard} lacks {len(missing)} tensor(s) the index assigns it, e.g. {min(missing)}")
        if extra:
            problems.append(
                f"{shard} holds {len(extra)} tensor(s) the index puts elsewhere or nowhere, e.g. {min(extra)}"
            )
    # the total is only comparable once every indexed shard is on disk
    complete = set(assigned) <= set(held)
    total = sum(f.bytes for f in ctx.files)
    if complete and ctx.index_total is not None and ctx.index_total != total:
        problems.append(f"metadata.total_size is {ctx.index_total:,} but the shards hold {total:,} bytes")
    return verdict(problems, f"{len(held)} of {len(assigned)} indexed shards on disk, each as indexed")
