"""A checkpoint on disk: inventory, headers, formats, tokenizer, audit, writers, the stores."""
