"""Host-side training: FP32, then quantization-aware fine-tuning with TF-MOT."""
