"""Named sites of a forward and the observers that subscribe to them.

A site is one point of the forward with a dotted name after the module that owns it
(`layers.3.ffn.routed`, `layers.3.resid_post`, `head`); `name_sites(root)` gives each module under
`root` the sites its class lists in `SITES` and returns the registry, name -> `Site`. The forward
asks a site whether anyone listens before it does anything for an observer, so a site nobody
subscribed to costs one lookup.

Observers are read-only: each observer is handed its own copy of the value (and of each tensor of
the context it reads), so writing into what it was handed, in place or through a `.numpy()` view,
changes neither what flows on nor what the next observer sees. The copies are made only where
someone listens. Changing what flows is an intervention: a separate, explicit registration, never
an observer.

An observer is a callable `fn(name, value, context)` called at a site's exit, or an object with
`enter(name)` and/or `exit(name, value, context)` (a clock); anything else is refused when it is
subscribed. `Sites.subscribe(pattern, observer)` returns a handle whose `remove()` ends it;
`with sites.hooks({pattern: observer, ...})` keeps them for a block. A pattern is a site name or
an fnmatch pattern (`layers.*.ffn.routed`); every pattern of a registration is checked before any
observer is added. `ActivationCache` records the values of the sites it is subscribed to, what
`run_with_hooks(model, ids)` returns beside the logits. `sites_of(module)` is the registry of one part
(an attention layer of a stack, say), under the names its model or stack gave it.

A site whose owner lists it in `REPLACEABLE` uses what its exit returns: with interventions
registered there (`Sites.add_interventions`, which `dsv41.model.interventions` calls), each in turn is
handed the value and returns the one that flows on, and the observers see that one. With none, the
exit returns the value it was given, the same object.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import torch

from ..core.errors import Dsv41Error
from ..core.text import brief


class HookError(Dsv41Error, ValueError):
    """A site pattern, an observer or a list of names the registry cannot take."""


class UnknownSiteError(HookError, KeyError):
    """A pattern that matches no site (a KeyError too, as it always was)."""

    def __str__(self) -> str:  # KeyError's own str() would quote the sentence
        return str(self.args[0]) if self.args else ""


class ReentrantCallError(Dsv41Error, RuntimeError):
    """A model called from inside one of its own forwards (from an observer)."""


class Subscription(NamedTuple):
    """One observer at one site: the object as subscribed and its bound enter / exit (None: absent)."""

    observer: Any
    enter: Optional[Callable]
    exit: Optional[Callable]


class Site:
    """One named point of the forward: the observers listening there, in subscription order, and
    (a `replaceable` site) the interventions that change what flows on, in registration order."""

    __slots__ = ("name", "observers", "interventions", "replaceable")

    def __init__(self, name: str, replaceable: bool = False):
        self.name = name
        # handle -> Subscription: a handle removes its own entry by identity in O(1), so two equal
        # observers (two empty ActivationCaches, say) stay two entries and never remove each other
        self.observers: dict[_Handle, Subscription] = {}
        self.interventions: dict[_Handle, Callable] = {}  # handle -> fn(name, value, context) -> value
        self.replaceable = replaceable  # the forward uses what exit returns

    def __bool__(self) -> bool:  # "is anyone listening or intervening": what the forward asks first
        return bool(self.observers) or bool(self.interventions)

    def enter(self) -> None:
        # a snapshot: an observer may subscribe or remove observers while it is called
        for subscription in tuple(self.observers.values()):
            if subscription.enter is not None:
                subscription.enter(self.name)

    def exit(self, value, context: Optional[dict] = None):
        """The value that flows on: `value` itself, or what the interventions put in its place;
        the observers are handed (copies of) that one."""
        for intervention in tuple(self.interventions.values()):
            value = intervention(self.name, value, context)
        for subscription in tuple(self.observers.values()):
            if subscription.exit is not None:
                seen = PrivateContext(self.name, context)
                try:
                    subscription.exit(self.name, _private(value), seen)
                finally:
                    seen.close()
        return value

    def around(self, fn: Callable, *args, **context):
        """fn(*args) between this site's enter and exit; returns what the exit returns."""
        self.enter()
        return self.exit(fn(*args), context)

    def __repr__(self) -> str:
        extra = f", {len(self.interventions)} interventions" if self.interventions else ""
        return f"Site({self.name!r}, {len(self.observers)} observers{extra})"


def _private(value):
    """`value` as one observer may keep and write into: each tensor a fresh copy, detached, with its
    own storage (so a `.numpy()` view of it reaches only the copy); containers rebuilt around them."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        copied = [_private(v) for v in value]
        return type(value)._make(copied) if hasattr(type(value), "_make") else tuple(copied)  # a NamedTuple stays one
    if isinstance(value, list):
        return [_private(v) for v in value]
    if isinstance(value, dict):
        return {k: _private(v) for k, v in value.items()}
    return value


class PrivateContext(Mapping):
    """A site's context as one observer (or intervention) sees it: each entry copied (`_private`) the first time the
    observer reads it, so an observer pays only for the entries it reads. Modules the context names
    (a gate, an indexer) are passed as they are. Once the observer has returned, what it read stays
    readable and the rest is refused: read later, it would be the forward's state of a later moment."""

    __slots__ = ("_site", "_shared", "_copied")

    def __init__(self, site: str, shared: Optional[dict]):
        self._site = site
        self._shared = shared if shared is not None else {}
        self._copied: dict = {}

    def __getitem__(self, key):
        if key not in self._copied:
            value = self._shared[key]
            if value is _GONE:
                raise HookError(
                    f"context[{key!r}] of site {self._site} was read after its observer returned; "
                    f"read the context inside the call (keep dict(context) to use it later)"
                )
            self._copied[key] = _private(value)
        return self._copied[key]

    def close(self) -> None:
        """The observer has returned: let go of the forward's own values it did not read."""
        if self._shared:
            self._shared = dict.fromkeys(self._shared, _GONE)

    def __contains__(self, key) -> bool:  # without copying what is asked about
        return key in self._shared

    def __iter__(self):
        return iter(self._shared)

    def __len__(self) -> int:
        return len(self._shared)

    def __repr__(self) -> str:
        return f"context({', '.join(map(str, self._shared))})"


_GONE = object()  # a context entry not read while its observer ran


def _subscription(pattern: str, observer) -> Subscription:
    """`observer` (subscribed at `pattern`) as a site calls it, or HookError when it is neither a
    callable nor an object with callable enter / exit."""
    enter, exit_ = getattr(observer, "enter", None), getattr(observer, "exit", None)
    if enter is None and exit_ is None and callable(observer):
        return Subscription(observer, None, observer)
    if (enter is not None or exit_ is not None) and all(f is None or callable(f) for f in (enter, exit_)):
        return Subscription(observer, enter, exit_)
    raise HookError(
        f"the observer for {pattern!r} is neither a callable fn(name, value, context) nor an object with "
        f"enter(name) and/or exit(name, value, context) methods: got {brief(observer)} "
        f"({type(observer).__name__})"
    )


class _Handle:
    """One registration's observers at their sites; `remove()` ends it (again: nothing more)."""

    __slots__ = ("_sites",)

    def __init__(self):
        self._sites: list[Site] = []

    def remove(self) -> None:
        for site in self._sites:
            site.observers.pop(self, None)
            site.interventions.pop(self, None)
        self._sites = []


class Sites(dict):
    """The registry of one model's sites: name -> Site, in module order (a module's own sites
    before its children's)."""

    def matching(self, pattern: str, strict: bool = True) -> list[Site]:
        """The sites `pattern` names; none is an error unless not `strict` (a pattern for a kind
        of layer this model may not have)."""
        if not isinstance(pattern, str):
            raise HookError(
                f"a site pattern is a site name or an fnmatch pattern (a str such as 'layers.*.ffn'), "
                f"got {brief(pattern)}; list(model.sites) gives the names"
            )
        if pattern in self:
            return [self[pattern]]
        found = [site for name, site in self.items() if fnmatch.fnmatchcase(name, pattern)]
        if not found and strict:
            raise UnknownSiteError(
                f"no site matches {pattern!r}; the sites are listed by model.sites (e.g. {', '.join(list(self)[:4])})"
            )
        return found

    def subscribe(self, pattern: str, observer, strict: bool = True) -> _Handle:
        """Add `observer` at every site `pattern` matches; returns a handle to remove it."""
        return self._subscribe_all([(pattern, observer)], strict)[0]

    @contextmanager
    def hooks(self, observers: Mapping[str, Any], strict: bool = True) -> Iterator["Sites"]:
        """{pattern: observer} subscribed for the block, removed after it (also on an error); every
        pattern and observer is checked before any is added."""
        if not isinstance(observers, Mapping):
            raise HookError(
                f"hooks takes a mapping {{site pattern: observer}}, got {brief(observers)} ({type(observers).__name__})"
            )
        with self._subscribed(list(observers.items()), strict):
            yield self

    @contextmanager
    def _subscribed(self, pairs: list, strict: bool) -> Iterator[None]:
        handles = self._subscribe_all(pairs, strict)
        try:
            yield
        finally:
            for handle in reversed(handles):
                handle.remove()

    def _subscribe_all(self, pairs: list, strict: bool) -> list[_Handle]:
        """One handle per (pattern, observer) pair, each pattern matched and each observer checked
        before anything is added, so a refused registration leaves the registry as it was. One
        observer object reached twice at a site by the pairs is added there once."""
        checked = [(self.matching(pattern, strict), _subscription(pattern, observer)) for pattern, observer in pairs]
        placed: set[tuple[int, int]] = set()
        handles = []
        for sites, subscription in checked:
            handle = _Handle()
            for site in sites:
                key = (id(site), id(subscription.observer))
                if key not in placed:
                    placed.add(key)
                    site.observers[handle] = subscription
                    handle._sites.append(site)
            handles.append(handle)
        return handles

    def add_interventions(self, pairs: list) -> list[_Handle]:
        """One handle per (pattern, fn) pair: fn(name, value, context) -> the value to use in its
        place, at every site `pattern` matches. Every pattern is matched, and every site it matches
        must be replaceable, before anything is added (HookError naming the first that is not)."""
        checked = []
        for pattern, fn in pairs:
            sites = self.matching(pattern)
            fixed = [site.name for site in sites if not site.replaceable]
            if fixed:
                replaceable = [name for name, site in self.items() if site.replaceable]
                raise HookError(
                    f"{pattern!r} matches {fixed[0]}, a site that can be observed but not replaced "
                    f"(e.g. replace the selection at its layer's attn.topk); the replaceable sites are "
                    f"{', '.join(replaceable[:6])}, ... ([n for n, s in model.sites.items() if s.replaceable])"
                )
            if not callable(fn):
                raise HookError(
                    f"the intervention for {pattern!r} is not a callable fn(name, value, context) -> "
                    f"value: got {brief(fn)} ({type(fn).__name__})"
                )
            checked.append((sites, fn))
        handles = []
        for sites, fn in checked:
            handle = _Handle()
            for site in sites:
                site.interventions[handle] = fn
                handle._sites.append(site)
            handles.append(handle)
        return handles

    def active_interventions(self) -> list[tuple[str, Callable]]:
        """(site name, intervention) of every intervention registered now, in module order."""
        return [(name, fn) for name, site in self.items() for fn in site.interventions.values()]

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
    (`layers.3.ffn` + "routed"); those the class also lists in `REPLACEABLE` take interventions.
    `renamed` {module path: site path} names a module and everything under it after another path
    (an attention stack's `layers.3` as a model's `layers.3.attn`)."""
    registry = Sites()
    for path, module in root.named_modules():
        local_names = getattr(module, "SITES", ())  # a class's, or one instance's own
        if not local_names:
            continue
        path = _renamed(path, renamed or {})
        replaceable = getattr(module, "REPLACEABLE", ())
        own = {}
        for local in local_names:
            name = ".".join(p for p in (path, local) if p)
            own[local] = registry[name] = Site(name, local in replaceable)
        module.named_sites = own
    return registry


@contextmanager
def without_sites(root) -> Iterator[None]:
    """For the block, every module under `root` answers "nobody is there" at each of its sites,
    as a forward ran before there were sites: what the registry's cost is measured against. What
    the sites feed (a draft stack's hidden state) is not fed meanwhile."""
    named = {m: m.__dict__["named_sites"] for m in root.modules() if "named_sites" in m.__dict__}
    try:
        for module in named:
            module.named_sites = {}  # a builtin lookup that finds nothing: the cheapest "nobody"
        yield
    finally:
        for module, sites in named.items():
            module.named_sites = sites


def _renamed(path: str, renamed: Mapping[str, str]) -> str:
    for old, new in renamed.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old) :]
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
    """`module`'s site `local` when someone listens or intervenes there, else None (the forward's
    one question)."""
    found = module.named_sites.get(local)
    return found if found else None


# ---------------------------------------------------------------------- observers
class ActivationCache(dict):
    """name -> the values a site produced during a run, one entry per call of the site (a prefill
    and each decode step append), detached; `cache[name]` is the list, `cache.last(name)` the
    most recent. Tensors stay where the forward left them unless `to_cpu`. The entries are the
    copies the site handed this cache, so no other observer and no later step reaches them."""

    def __init__(self, to_cpu: bool = False):
        super().__init__()
        self.to_cpu = to_cpu

    def __call__(self, name: str, value, context: Mapping) -> None:
        self.setdefault(name, []).append(_on_cpu(value) if self.to_cpu else value)

    def last(self, name: str):
        return self[name][-1]


def _on_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, tuple):
        return tuple(_on_cpu(v) for v in value)
    return value


def _patterns(names) -> list[str]:
    """`names` as a list of patterns: one str is one name (not its characters)."""
    if isinstance(names, str):
        return [names]
    if isinstance(names, Iterable) and not isinstance(names, (bytes, Mapping)):
        return list(names)
    raise HookError(
        f"names takes a site pattern or a list of them (e.g. ['layers.*.ffn.routed', 'head']), "
        f"got {brief(names)} ({type(names).__name__})"
    )


def run_with_hooks(
    model,
    input_ids,
    start_pos: int = 0,
    *,
    names: Union[str, Iterable[str]] = ("*",),
    observers: Optional[Mapping[str, Any]] = None,
    to_cpu: bool = False,
    **call_kw,
):
    """`model(input_ids, start_pos, **call_kw)` with an `ActivationCache` subscribed at every site
    a pattern in `names` matches (all by default; one str is one pattern) and `observers`
    ({pattern: observer}) for the call -> (logits, cache). Every pattern is checked before anything
    is subscribed. The call advances the sequence as any call does."""
    if observers is not None and not isinstance(observers, Mapping):
        raise HookError(
            f"observers takes a mapping {{site pattern: observer}}, got {brief(observers)} ({type(observers).__name__})"
        )
    cache = ActivationCache(to_cpu)
    pairs = [*(observers or {}).items(), *((pattern, cache) for pattern in _patterns(names))]
    with model.sites._subscribed(pairs, strict=True):
        logits = model(input_ids, start_pos, **call_kw)
    return logits, cache
