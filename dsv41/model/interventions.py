"""Interventions: what flows through a named site, changed for the calls of a block.

`intervene(sites, {pattern: fn})` (what `Model.intervene` calls) registers fn(name, value,
context) -> the value to use in its place at every site the pattern matches, through the same
registry as the observers (`hooks`), and removes it after the block, also on an error. Only sites
whose owner uses the replacement take one (`Site.replaceable`: the embedding, each block's Engram,
residual streams, hyper-connection mixes, attention and its `topk`, the FFN and its gate and halves,
the head); a pattern reaching another is refused before anything is registered.

Each fn is handed the forward's own value (return it unchanged and the forward is bit for bit what
it was without the fn) and the site's context as an observer sees it, each entry copied where it is
read, with "start_pos", the call's first position, added where the registry belongs to a model.
What it returns is checked against the form the site takes before it flows on (`InterventionError`
naming the site otherwise): at `ffn.gate` a pair (weights [n, k'], expert ids [n, k'] of experts the
layer has, the dtypes as given): the experts the layer then computes; at `attn.topk` the compressed
positions [b, s, any width] each query reads, -1 for none, never one past its reach; everywhere else
a value of the same structure, each tensor of the shape, dtype and device it was given.

Several fns at one site run in registration order, each handed the previous one's value; the
observers see the last, so a trace records what flowed, and notes which interventions were active
(`Trace.interventions`, from `Sites.active_interventions` and `label`). `open_labels()` names every
intervention registered by a block still open anywhere, so a figure exported inside one says so
(`viz.export_figure`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from ..core.errors import Dsv41Error
from ..core.text import brief
from .hooks import HookError, PrivateContext, Sites


class InterventionError(Dsv41Error, ValueError):
    """An intervention returned a value the site cannot take in place of the one it was handed."""


def label(fn) -> str:
    """How an intervention is named in a trace and on a figure: its `label` attribute, else its
    function's name, else its type's name."""
    given = getattr(fn, "label", None)
    if isinstance(given, str) and given:
        return given
    return getattr(fn, "__name__", None) or type(fn).__name__


# one list of labels per block open now, in the order they opened (see open_labels)
_OPEN: list[list[str]] = []


def open_labels() -> list[str]:
    """ "site pattern: label" of every intervention registered by a block that is still open."""
    return [entry for block in _OPEN for entry in block]


@contextmanager
def intervene(
    sites: Sites, interventions: Mapping[str, Any], *, position: Optional[Callable[[], int]] = None
) -> Iterator[Sites]:
    """{pattern: fn} registered at `sites` for the block, removed after it (also on an error);
    every pattern and fn is checked before any is registered. `position()`: the first position of
    the call running now (a model's `position` during its forward), handed to each fn as the
    context's "start_pos"."""
    if not isinstance(interventions, Mapping):
        raise HookError(
            f"intervene takes a mapping {{site pattern: fn(name, value, context) -> value}}, got "
            f"{brief(interventions)} ({type(interventions).__name__})"
        )
    for pattern, fn in interventions.items():
        if not callable(fn):  # said here, naming the fn as given rather than the wrapper registered
            raise HookError(
                f"the intervention for {pattern!r} is not a callable fn(name, value, context) -> value: "
                f"got {brief(fn)} ({type(fn).__name__})"
            )
    handles = sites.add_interventions([(pattern, _Checked(fn, position)) for pattern, fn in interventions.items()])
    block = [f"{pattern}: {label(fn)}" for pattern, fn in interventions.items()]
    _OPEN.append(block)
    try:
        yield sites
    finally:
        _OPEN.remove(block)
        for handle in reversed(handles):
            handle.remove()


class _Checked:
    """One registered fn: called with a private context, what it returns checked at the site."""

    __slots__ = ("fn", "position", "label")

    def __init__(self, fn, position: Optional[Callable[[], int]]):
        self.fn, self.position, self.label = fn, position, label(fn)

    def __call__(self, name: str, value, context: Optional[dict]):
        shared = dict(context or {})
        if self.position is not None:
            shared.setdefault("start_pos", self.position())
        seen = PrivateContext(name, shared)
        try:
            returned = self.fn(name, value, seen)
        finally:
            seen.close()
        kind = name.rsplit(".", 1)[-1]
        if kind == "topk":
            return _selection(name, value, returned, shared)
        if kind == "gate":
            return _routing(name, value, returned, shared)
        _same_form(name, value, returned)
        return returned


def _refuse(name: str, what: str) -> InterventionError:
    return InterventionError(
        f"the intervention at {name} returned {what}; return the value it was handed or one of its form"
    )


def _same_form(name: str, given, returned, where: str = "") -> None:
    """`returned` has the structure of `given`, each tensor its shape, dtype and device."""
    if isinstance(given, torch.Tensor):
        if not isinstance(returned, torch.Tensor):
            raise _refuse(name, f"{brief(returned)} ({type(returned).__name__}){where}, not a tensor")
        if (returned.shape, returned.dtype, returned.device) != (given.shape, given.dtype, given.device):
            raise _refuse(
                name,
                f"a {returned.dtype} tensor {list(returned.shape)} on {returned.device}{where} where the site "
                f"holds a {given.dtype} tensor {list(given.shape)} on {given.device}",
            )
    elif isinstance(given, tuple):
        if not isinstance(returned, tuple) or len(returned) != len(given):
            raise _refuse(name, f"{brief(returned)}{where}, not a tuple of {len(given)} like the one it was handed")
        for i, (a, b) in enumerate(zip(given, returned)):
            _same_form(name, a, b, f"{where} (item {i})")
    elif type(returned) is not type(given):
        raise _refuse(name, f"{brief(returned)}{where} where the site holds a {type(given).__name__}")


def _routing(name: str, given, returned, context: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate's replacement: (weights [n, k'], ids [n, k']) with the given dtypes, every id an
    expert of the layer."""
    weights, ids = given
    if not (isinstance(returned, tuple) and len(returned) == 2 and all(isinstance(t, torch.Tensor) for t in returned)):
        raise _refuse(name, f"{brief(returned)}, not a pair of tensors (weights, expert ids)")
    new_weights, new_ids = returned
    if new_weights.dtype != weights.dtype or new_ids.dtype != ids.dtype:
        raise _refuse(
            name,
            f"weights of {new_weights.dtype} and ids of {new_ids.dtype} (the site holds {weights.dtype}, {ids.dtype})",
        )
    if new_ids.dim() != 2 or new_ids.shape != new_weights.shape or new_ids.size(0) != ids.size(0):
        raise _refuse(
            name,
            f"weights {list(new_weights.shape)} and ids {list(new_ids.shape)} where the site routes "
            f"{ids.size(0)} tokens: give both [{ids.size(0)}, k]",
        )
    n_experts = context["gate"].weight.size(0)
    if new_ids.numel() and not (0 <= int(new_ids.min()) and int(new_ids.max()) < n_experts):
        raise _refuse(
            name,
            f"expert ids from {int(new_ids.min())} to {int(new_ids.max())}; the layer has experts 0 to {n_experts - 1}",
        )
    return new_weights, new_ids


def _selection(name: str, given: torch.Tensor, returned, context: dict) -> torch.Tensor:
    """An attention layer's compressed positions [b, s, any width] (any integer dtype, held as the
    given one), -1 for none, each a position its query reaches: (position + 1) // ratio."""
    if not isinstance(returned, torch.Tensor) or returned.dtype.is_floating_point or returned.dtype == torch.bool:
        raise _refuse(name, f"{brief(returned)}, not an integer tensor of compressed positions")
    if returned.dim() != 3 or returned.shape[:2] != given.shape[:2]:
        raise _refuse(
            name, f"a tensor {list(returned.shape)}; give [{given.size(0)}, {given.size(1)}, width] positions"
        )
    start, seqlen = context["start_pos"], given.size(1)
    reach = (torch.arange(start, start + seqlen, device=returned.device) + 1) // context["compress_ratio"]  # [s]
    if returned.numel() and (bool((returned < -1).any()) or bool((returned >= reach.view(1, -1, 1)).any())):
        raise _refuse(
            name,
            "a compressed position below -1 or past its query's reach (query at position p reaches "
            f"positions below (p + 1) // {context['compress_ratio']})",
        )
    return returned.to(device=given.device, dtype=given.dtype)
