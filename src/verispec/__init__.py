"""verispec: lossless speculative decoding."""
