"""Reads an XLA CPU profile of one jitted program and splits its wall time into categories.

`trace_breakdown(runner, step_input, num_steps, weight_dims)` runs the engine's compiled step under
`jax.profiler`, keeps the events whose names are instructions of the compiled HLO (XLA:CPU emits one
event per thunk: a fusion, a YNNPACK matmul, a while loop, ...), and attributes them:

  - category of an instruction: from its `op_name` metadata, which carries the Flax module path
    (".../layers/mlp/TD,DF->TF/dot_general"), and its shape (`classify`);
  - nested events (a while loop's thunk holds its body's thunks): each instant belongs to the
    innermost event running on that thread (`leaf_segments`);
  - two threads: each instant of wall time is shared equally among the events running then, so
    the categories' wall times add up to the time at least one thread was busy. `thread_ms` sums
    busy time per thread instead (up to 2x wall on 2 cores).
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time


def classify(hlo_text: str, weight_dims: set[int], split_attention: bool = False) -> dict[str, str]:
    """HLO instruction name -> category, from its op_name metadata (the Flax module path) and shape.
    `split_attention`: attention's page gather, its matmuls and the rest (masks, softmax) apart."""
    cats = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s+(?:ROOT )?%(\S+) = (.*)$", line)
        if not m:
            continue
        name, rest = m.groups()
        opcode = re.search(r" ([a-z][a-z0-9_-]*)\(", rest)
        opcode = opcode.group(1) if opcode else ""
        shape = re.match(r"\w+\[([\d,]*)\]", rest)  # None for tuple shapes
        dims = [int(d) for d in shape.group(1).split(",") if d] if shape else []
        op_name = re.search(r'op_name="([^"]*)"', rest)
        op_name = op_name.group(1) if op_name else ""
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        target = target.group(1) if target else ""
        if target.startswith(("jaxpaged_gguf_matmul", "jaxpaged_gguf_panels", "jaxpaged_dense_matmul")):  # C++ kernels
            cat = ("LM head matmul" if "/lm_head/" in op_name else "MLP matmuls (gate, up, down)" if "/mlp/" in op_name
                   else "attention projections (q, k, v, o)")  # (jaxpaged/ops/cpu/; panels: a tied head too)
        elif target.startswith("jaxpaged_paged_attention"):
            cat = "attention: C++ decode kernel" if split_attention else "attention (page gather, softmax, PV)"
        elif target.startswith("jaxpaged_ragged_attention"):
            cat = "attention: C++ ragged kernel" if split_attention else "attention (page gather, softmax, PV)"
        elif "/attn/while" in op_name and split_attention:
            if "gather" in op_name or opcode == "gather":
                cat = "attention: page gather"
            elif "dot_general" in op_name:
                cat = "attention: QK^T and PV matmuls"
            else:
                cat = "attention: masks, online softmax"
        elif "/attn/while" in op_name:
            cat = "attention (page gather, softmax, PV)"
        elif "scatter" in name or "scatter" in op_name:
            cat = "KV write (scatter)"
        elif "/lm_head/" in op_name or ("dot_general" in op_name and "SD,DV->SV" in op_name):
            cat = "LM head matmul"  # the lm_head scope: with the CPU vocabulary-major head, its transpose too
        elif "dot_general" in op_name and "/mlp/" in op_name:
            cat = "MLP matmuls (gate, up, down)"
        elif "dot_general" in op_name and "/attn/" in op_name:
            cat = "attention projections (q, k, v, o)"
        elif "gguf_dequantize" in op_name:
            cat = "GGUF block dequantization"  # quantization="gguf": a layer's codes to float weights
        elif opcode == "fusion" and len(dims) == 2 and set(dims) <= weight_dims:
            cat = "per-layer weight slice copies"  # a layer's matrix copied out of the stacked params
        elif opcode in ("while", "conditional", "call"):
            cat = "loop control"
        else:
            cat = "norms, RoPE, residuals, embedding, other"
        cats[name] = cat
    return cats


def leaf_segments(events: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Nested events of one thread -> (start, end, name) pieces where `name` is the innermost event."""
    out, stack = [], []  # stack entries: [end, name, cursor (start of the parent's next own piece)]
    for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            top = stack.pop()
            out.append((top[2], top[0], top[1]))
            if stack:
                stack[-1][2] = top[0]
        if stack:
            out.append((stack[-1][2], start, stack[-1][1]))
        stack.append([end, name, start])
    while stack:
        top = stack.pop()
        out.append((top[2], top[0], top[1]))
        if stack:
            stack[-1][2] = top[0]
    return [s for s in out if s[1] > s[0]]


def trace_breakdown(runner, step_input, num_steps: int, weight_dims: set[int], split_attention: bool = False) -> dict:
    import jax
    from jax.profiler import ProfileData

    cats = classify(runner.trace_step(step_input).lower().compile().as_text(), weight_dims, split_attention)
    trace_dir = tempfile.mkdtemp(prefix="jaxpaged_decode_trace_")
    jax.profiler.start_trace(trace_dir)
    t0 = time.perf_counter()
    for _ in range(num_steps):
        runner.execute(step_input).block_until_ready()
    traced_wall = (time.perf_counter() - t0) / num_steps
    jax.profiler.stop_trace()
    data = ProfileData.from_file(max(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)))
    segments, unknown = [], collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            evs = [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events if e.name in cats]
            unknown.update(e.name for e in line.events if e.name not in cats)
            segments += [(s, e, cats[n]) for s, e, n in leaf_segments(evs)]
    # Sweep all threads' pieces: each instant's wall time is shared among the pieces running then.
    points = sorted({p for s, e, _ in segments for p in (s, e)})
    index = {p: i for i, p in enumerate(points)}
    active = [collections.Counter() for _ in points]
    for s, e, cat in segments:
        active[index[s]][cat] += 1
        active[index[e]][cat] -= 1
    wall, thread, running = collections.Counter(), collections.Counter(), collections.Counter()
    both_busy = busy = 0.0
    for i in range(len(points) - 1):
        running.update(active[i])
        k = sum(running.values())
        if k <= 0:
            continue
        dt = (points[i + 1] - points[i]) / 1e6 / num_steps  # ms per step
        busy += dt
        both_busy += dt if k > 1 else 0.0
        for cat, c in running.items():
            if c > 0:
                wall[cat] += dt * c / k
                thread[cat] += dt * c
    return {"traced_step_ms": traced_wall * 1e3, "busy_wall_ms": busy, "both_threads_busy_ms": both_busy,
            "wall_ms": dict(wall), "thread_ms": dict(thread),
            "events_not_in_hlo": dict(unknown.most_common(8))}
