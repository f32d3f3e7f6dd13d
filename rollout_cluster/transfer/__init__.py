"""Weights without a filesystem: a trainer's tensors to every replica in buckets (push_weights)."""
