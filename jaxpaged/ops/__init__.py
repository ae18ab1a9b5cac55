"""jnp building blocks the models call: paged attention in plain jnp (the reference and the CPU
path, attention.py) and the quantized KV page format (kv_quant.py). The Pallas kernels are the
sibling package `pallas_kernels`."""
