"""`Model` stays short: it is where a forward starts (the call, reset, attach, the sites and hooks,
the draft, the text verbs). A verb over a model is a free function in the module that owns what it
does, taking the model first: generation in `dsv41.generation.generate`, chat in `dsv41.generation.conversation`,
`run_with_hooks` in `dsv41.model.hooks`, rollback and snapshots in `dsv41.model.sequence`."""

from dsv41.model.model import Model

# the bound issue 35 set ("`Model` at most about 20 methods"), counting what a reader of the class
# reads: public and private methods, dunders and properties alike
MOST_METHODS = 20


def _methods(cls) -> list[str]:
    return [
        name
        for name, value in vars(cls).items()
        if callable(value) or isinstance(value, (property, staticmethod, classmethod))
    ]


def test_model_has_at_most_about_twenty_methods():
    methods = _methods(Model)
    assert len(methods) <= MOST_METHODS, (
        f"Model has {len(methods)} methods and properties ({', '.join(methods)}), more than {MOST_METHODS}: "
        f"write a new verb as a free function taking the model, in the module that owns what it does "
        f"(dsv41.generation.generate, dsv41.model.sequence, dsv41.model.hooks, ...), not as a method "
        f"that forwards to one"
    )


def test_the_count_sees_every_kind_of_member():
    class Probe:
        def method(self): ...

        def _private(self): ...

        def __call__(self): ...

        @property
        def prop(self): ...

        @staticmethod
        def static(): ...

        @classmethod
        def built(cls): ...

        attribute = 3

    assert _methods(Probe) == ["method", "_private", "__call__", "prop", "static", "built"]
