"""Data sets that need no download: byte-level text for training and testing the reference models."""

from tessera.data.text import ByteSequences, byte_datasets, load_byte_corpus, split_sequences

__all__ = ["ByteSequences", "byte_datasets", "load_byte_corpus", "split_sequences"]
