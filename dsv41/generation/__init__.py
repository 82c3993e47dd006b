"""Generation over a model it only calls: prefill and decode, speculative decoding, chat."""
