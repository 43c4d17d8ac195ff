"""Speculative decoding: proposers draft tokens, the runner verifies all of them in one forward (runner/spec_verify.py),
and model states roll recurrent state back to the last accepted token (docs/speculative_decoding.md)."""
