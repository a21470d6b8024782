"""mlagen: specialized MLA verify-attention kernels for speculative decoding (split-KV partial + combine)."""

__version__ = "0.1.0"
