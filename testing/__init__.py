"""Test helpers: a tiny byte-level tokenizer and random-weight HF checkpoints, built offline."""
from headrace.testing.checkpoint import demo_checkpoint, make_checkpoint
from headrace.testing.tokenizer import CORPUS, build_tokenizer

__all__ = ["CORPUS", "build_tokenizer", "demo_checkpoint", "make_checkpoint"]
