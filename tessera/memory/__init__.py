"""Layer 3: memory. For now the memory report (the chunk store and Gemini come later)."""

from tessera.memory.report import model_state_bytes, peak_rss_bytes, reset_peak_rss

__all__ = ["model_state_bytes", "peak_rss_bytes", "reset_peak_rss"]
