"""What a run reads and writes: checkpoints, training data and documents, Hugging Face weights, metrics and telemetry."""
