"""The optimizer update inside the backward pass (`optimizer.update_in_backward`)."""
