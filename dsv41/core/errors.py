"""The one base of every error dsv41 raises on purpose.

`except dsv41.Dsv41Error` catches all of them; each type keeps the built-in base it had (a
`ValueError` for bad input, a `RuntimeError` for a failing run), so older `except ValueError`
code keeps working."""


class Dsv41Error(Exception):
    pass
