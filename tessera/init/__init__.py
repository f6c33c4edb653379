"""Deferred initialisation: build a model without memory, then make only what each rank keeps."""

from tessera.init.recording import DeferredInitError, Recording, deferred_init, recording_of

__all__ = ["DeferredInitError", "Recording", "deferred_init", "recording_of"]
