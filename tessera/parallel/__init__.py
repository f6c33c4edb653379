"""Layer 3: parallel strategies (data; tensor, pipeline and sequence come in their own folders)."""
