"""Every XLA executable JAX builds inside a block, by function name.

The engines' own counters (`stats()["num_compiles"]`) count traces of the step. jit also keys its
cache on things that need no new trace, for instance whether an input is committed to a device, and
such a miss compiles (or loads from the persistent cache) without tracing: invisible to a trace
counter. JAX reports every backend compile, persistent-cache hits included, as one duration event
(`/jax/core/compile/backend_compile_duration`); this listens for it."""

import contextlib

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles():
    """with backend_compiles() as compiled: ...  -> compiled: the names of the functions compiled."""
    compiled: list[str] = []

    def listen(event, duration_secs, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            compiled.append(kwargs.get("fun_name", "?"))

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        monitoring.unregister_event_duration_listener(listen)
