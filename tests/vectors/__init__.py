"""Shared test vectors: float64-reference answers for GDN, KDA, SSD and conv1d, loaded by jaxckpt and torch_bridge."""
