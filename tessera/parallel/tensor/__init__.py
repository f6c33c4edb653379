"""Tensor parallelism in four modes: 1d (Megatron), 2d (SUMMA), 2.5d (Tesseract), 3d.

Each mode lives in its own module (``tp1d.py``, ``tp2d.py``, ``tp2p5d.py``, ``tp3d.py``), a
functional core plus thin ``nn.Module`` layers; ``common.py`` holds what they share.
"""
