"""The device side: everything that touches jax arrays for a step.

    step_input.py     StepInput, the one host->device contract (numpy only)
    kv_cache.py       the KV pool's layout and bytes per page, pool sizing
    runner.py         ModelRunner: the jitted step over the donated KV buffer, page copies
    param_dtypes.py   which weights an engine takes (floats; another precision cast with a warning)
    kv_transfer.py    device <-> host page transfers (swap, host tier)
    sharding.py       tensor-parallel meshes and layouts
    backends.py       the attention backend chosen by name
"""
