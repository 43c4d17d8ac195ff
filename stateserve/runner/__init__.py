"""The model runner shared by every model: loads weights, sizes and binds caches, runs steps, samples."""
