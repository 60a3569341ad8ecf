"""Decoding strategies: tensors in, tensors out, one file per algorithm."""
