"""The train program and the levers it is built from: layout, sharding, remat, offload, precision, the optimizer and the step."""
