"""Named sites of a forward and the observers that subscribe to them.

A site is one point of the forward with a dotted name after the module that owns it
(`layers.3.ffn.routed`, `layers.3.resid_post`, `head`); `name_sites(root)` gives each module under
`root` the sites its class lists in `SITES` and returns the registry, name -> `Site`. The forward
asks a site whether anyone listens before it does anything for an observer, so a site nobody
subscribed to costs one lookup, and no observer changes the arithmetic: it sees the values (and,
for `Site.around`, the start and end of the computation), never replaces them.

An observer is a callable `fn(name, value, context)` called at a site's exit, or an object with
`enter(name)` and/or `exit(name, value, context)` (a clock). `Sites.subscribe(pattern, observer)`
returns a handle whose `remove()` ends it; `with sites.hooks({pattern: observer, ...})` keeps them
for a block. A pattern is a site name or an fnmatch pattern (`layers.*.ffn.routed`).
`ActivationCache` records the values of the sites it is subscribed to, what
`Model.run_with_hooks` returns beside the logits. `sites_of(module)` is the registry of one part
(an attention layer of a stack, say), under the names its model or stack gave it.
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional


class Site:
    """One named point of the forward and the observers listening there, in subscription order."""

    __slots__ = ("name", "observers")

    def __init__(self, name: str):
        self.name = name
        self.observers: list = []

    def __bool__(self) -> bool:  # "is anyone listening": what the forward asks first
        return bool(self.observers)

    def enter(self) -> None:
        for observer in self.observers:
            enter = getattr(observer, "enter", None)
            if enter is not None:
                enter(self.name)

    def exit(self, value, context: Optional[dict] = None) -> None:
        for observer in self.observers:
            exit_ = getattr(observer, "exit", None) if not _plain(observer) else observer
            if exit_ is not None:
                exit_(self.name, value, context or {})

    def around(self, fn: Callable, *args, **context):
        """fn(*args) between this site's enter and exit (its result the exit's value)."""
        self.enter()
        value = fn(*args)
        self.exit(value, context)
        return value

    def __repr__(self) -> str:
        return f"Site({self.name!r}, {len(self.observers)} observers)"


def _plain(observer) -> bool:
    """A bare callable (not an object with enter/exit) observes exits only."""
    return callable(observer) and not hasattr(observer, "exit") and not hasattr(observer, "enter")


class _Handle:
    def __init__(self, pairs: list):
        self._pairs = pairs

    def remove(self) -> None:
        for site, observer in self._pairs:
            if observer in site.observers:
                site.observers.remove(observer)
        self._pairs = []


class Sites(dict):
    """The registry of one model's sites: name -> Site, in module order (a module's own sites
    before its children's)."""

    def matching(self, pattern: str, strict: bool = True) -> list[Site]:
        """The sites `pattern` names; none is an error unless not `strict` (a pattern for a kind
        of layer this model may not have)."""
        if pattern in self:
            return [self[pattern]]
        found = [site for name, site in self.items() if fnmatch.fnmatchcase(name, pattern)]
        if not found and strict:
            raise KeyError(f"no site matches {pattern!r}; the sites are listed by model.sites "
                           f"(e.g. {', '.join(list(self)[:4])})")
        return found

    def subscribe(self, pattern: str, observer, strict: bool = True) -> _Handle:
        """Add `observer` at every site `pattern` matches; returns a handle to remove it."""
        pairs = [(site, observer) for site in self.matching(pattern, strict)]
        for site, obs in pairs:
            site.observers.append(obs)
        return _Handle(pairs)

    @contextmanager
    def hooks(self, observers: Mapping[str, Any], strict: bool = True) -> Iterator["Sites"]:
        """{pattern: observer} subscribed for the block, removed after it (also on an error)."""
        handles = []
        try:
            for pattern, observer in observers.items():
                handles.append(self.subscribe(pattern, observer, strict))
            yield self
        finally:
            for handle in reversed(handles):
                handle.remove()

    def clear_observers(self) -> None:
        for site in self.values():
            site.observers.clear()


# ---------------------------------------------------------------------- naming
class _NoSites(dict):
    """What a module's `sites` is before `name_sites`: every lookup None, nothing emitted."""

    def get(self, key, default=None):
        return None


NO_SITES = _NoSites()


def name_sites(root, renamed: Optional[Mapping[str, str]] = None) -> Sites:
    """Give every module under `root` whose class lists `SITES` its named sites and return the
    registry. A local name "" is the module's own path (`head`); others are appended
    (`layers.3.ffn` + "routed"). `renamed` {module path: site path} names a module and everything
    under it after another path (an attention stack's `layers.3` as a model's `layers.3.attn`)."""
    registry = Sites()
    for path, module in root.named_modules():
        local_names = getattr(module, "SITES", ())  # a class's, or one instance's own
        if not local_names:
            continue
        path = _renamed(path, renamed or {})
        own = {}
        for local in local_names:
            name = ".".join(p for p in (path, local) if p)
            own[local] = registry[name] = Site(name)
        module.named_sites = own
    return registry


def _renamed(path: str, renamed: Mapping[str, str]) -> str:
    for old, new in renamed.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old):]
    return path


def sites_of(module) -> Sites:
    """The sites under `module` as a registry: those it already has (named by the model or stack
    it belongs to, under those names), else named now from `module` as the root."""
    found = Sites()
    for _, part in module.named_modules():
        for named in getattr(part, "named_sites", NO_SITES).values():
            found[named.name] = named
    return found if found else name_sites(module)


def site(module, local: str) -> Optional[Site]:
    """`module`'s site `local` when someone listens there, else None (the forward's one question)."""
    found = module.named_sites.get(local)
    return found if found else None


# ---------------------------------------------------------------------- observers
class ActivationCache(dict):
    """name -> the values a site produced during a run, one entry per call of the site (a prefill
    and each decode step append), detached; `cache[name]` is the list, `cache.last(name)` the
    most recent. Tensors stay where the forward left them unless `to_cpu`."""

    def __init__(self, to_cpu: bool = False):
        super().__init__()
        self.to_cpu = to_cpu

    def __call__(self, name: str, value, context: dict) -> None:
        self.setdefault(name, []).append(_detached(value, self.to_cpu))

    def last(self, name: str):
        return self[name][-1]


def _detached(value, to_cpu: bool):
    if hasattr(value, "detach"):
        value = value.detach()
        return value.cpu() if to_cpu else value.clone()
    if isinstance(value, tuple):
        return tuple(_detached(v, to_cpu) for v in value)
    return value


def run_with_hooks(model, input_ids, start_pos: int = 0, *, names=("*",), observers: Optional[Mapping] = None,
                   to_cpu: bool = False, **call_kw):
    """`model(input_ids, start_pos, **call_kw)` with an `ActivationCache` subscribed at every site
    a pattern in `names` matches (all by default) and `observers` ({pattern: observer}) for the
    call -> (logits, cache). The call advances the sequence as any call does."""
    cache = ActivationCache(to_cpu)
    subscribed = dict(observers or {})
    registry = model.sites
    with registry.hooks(subscribed):
        handles = [registry.subscribe(pattern, cache) for pattern in names]
        try:
            logits = model(input_ids, start_pos, **call_kw)
        finally:
            for handle in handles:
                handle.remove()
    return logits, cache
