"""Host offload as a feature: params, optimizer state and activations in pinned host memory."""
