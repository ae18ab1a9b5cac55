"""The planner: what runs where, on the host. Standard library and numpy only, never jax.

    request.py        SamplingParams, seeds, every stop rule (the request lifecycle)
    sequence.py       one sequence's tokens, progress and pages
    page_pool.py      device pages: free list, ref counts, copy-on-write
    prefix_cache.py   hash chains over full pages, the LRU of cached pages
    host_pool.py      host pages (swap space and the prefix cache's host tier)
    block_manager.py  pages for sequences: allocate, append, fork, free
    swap_space.py     swapping a sequence's pages to host and back (shared again where still cached)
    scheduler.py      one step's plan (SchedulerOutput), advance at dispatch, commit when tokens land
"""
