"""Training the miniature: the corpus every machine has (`corpus`), a differentiable twin of the
forward (`twin`), the training loop with its checkpoints (`loop`), the learning-rate schedule both
its phases follow (`schedule`), the DSpark draft's training on the frozen target (`draft`) and
the release-format writer of the result (`release`)."""
