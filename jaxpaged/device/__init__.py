"""The device side: everything that touches jax arrays for a step.

    step_input.py     StepInput, the one host->device contract (numpy only)
    kv_cache.py       the KV pool's layout and bytes per page, pool sizing
    runner.py         ModelRunner: the jitted step over the donated KV buffer, page copies
    param_dtypes.py   which weights an engine takes (floats; another precision cast with a warning)
    sampling.py       the sampler rows of a step (params, seeds, the min_tokens ban) and its jitted call
    sampler.py        the jitted sampler (temperature, top-k/p, min-p, seeded draws, beam candidates)
    kv_transfer.py    device <-> host page transfers (swap, host tier)
    sharding.py       tensor-parallel meshes and layouts
    backends.py       the attention backend chosen by name
"""
