"""Studies of a model as plain data, and the figures that show them."""
