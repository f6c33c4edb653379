"""Tensor parallelism in four modes: 1d (Megatron), 2d (SUMMA), 2.5d (Tesseract), 3d.

Each mode is a package (``tp1d/``, ``tp2d/``, ``tp2p5d/``, ``tp3d/``) holding its functional core
(``functional.py``: the layout and the math, on explicit groups and grids), its ``nn.Module``
layers (``layers.py``, each taking ``ctx=``) and its registry entry (``mode.py``). Shared by the
modes: ``common.py`` (shard specs and parameters), ``grid.py`` (a rank's coordinates on the SUMMA
grid and the 3D cube), ``summa.py`` (the SUMMA steps of 2D and 2.5D), ``plain.py`` (reference
layers and the single-rank mode). ``mode.py`` defines :class:`TensorMode`, the interface every
mode offers with the same signatures, and ``modes.py`` the registry ``MODES`` that ``tessera.nn``
looks its layers up in. Nothing here reads the current context or imports ``tessera.nn``.
"""
