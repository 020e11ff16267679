"""Which layers are hard to quantize, why, and what precision plan meets a budget."""
