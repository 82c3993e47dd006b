"""Training the miniature: the corpus every machine has (`corpus`), the model's own forward over
float32 master weights (`masters`), the training loop with its checkpoints (`loop`), the
learning-rate schedule both its phases follow (`schedule`), the DSpark draft's training on the
frozen target (`draft`) and the release-format writer of the result (`release`)."""
