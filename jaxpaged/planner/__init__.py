"""The planner: what runs where, on the host. Standard library and numpy only, never jax.

    request.py        SamplingParams, seeds, every stop rule (the request lifecycle)
    structured_params.py  StructuredOutputsParams: what a request's output must match (shape checks)
    sequence.py       one sequence's tokens, progress and pages
    prefix_cache.py   hash chains over full pages, the LRU of cached pages
    host_pool.py      host pages (swap space and the prefix cache's host tier)
    block_manager.py  pages for sequences: allocate, append, fork, free, copy-on-write, swap to host and back
    sliding_window.py a block manager that frees pages the window has moved past
    scheduler.py      one step's plan (SchedulerOutput), advance at dispatch, commit when tokens land
"""
