"""The static profile: a jitted program compiled for an H100 / H200 SXM (one, or a tensor-parallel mesh
of virtual ones) on a machine without a GPU, and read.

Kernel launches, device-to-device copies, HBM bytes per launch, the Pallas kernels' registers and
occupancy. Every figure is an estimate read from the compiled program; nothing runs on a GPU.

    target.py          the chips' numbers (`H100` from h100_sxm.txtpb, XLA's target description; `H200`
                       from h200_sxm.txtpb), the child process's environment (`h100_env`), `spec`,
                       `compile_for_h100`, `chip_sharding` / `chip_mesh` (1x1xN virtual devices)
    hlo_text.py        optimized HLO text -> computations, instructions, shapes, bytes
    fusions.py         what one fused computation reads and writes (slices, in-place updates, memcpys, FLOPs)
    aliases.py         which values are one entry parameter's buffer (the KV pool), through loops and aliases
    hlo_accounting.py  account(hlo_text, override): launches, copies, bytes per launch
    thunks.py          the dumped thunk sequence (CUDA graphs: `command_buffers`), cross_check against it
    floors.py          bytes, launch-aware (+ launches x PER_LAUNCH_S, an estimate) and NVLink floors per chip
    ptxas_report.py    `ptxas -arch=sm_90a -v` on each Pallas kernel's PTX: registers, spills, smem, occupancy
    step_profile.py    one engine step program compiled and read (benchmarks/bench_h100_static.py's rows)
    gate.py            the CI gate's measurement (tests/test_h100_static_gate.py holds its budgets)

The toolchain (the CUDA PJRT plugin, ptxas and libdevice) is installed once, apart from the system
python, by `bash scripts/install_h100_toolchain.sh [DIR]` (default `<repo>/.h100-toolchain`, or
$JAXPAGED_H100_TOOLCHAIN). Compiling happens in a child process whose environment `h100_env()` builds:

    PYTHONPATH    <toolchain>:<repo>     jax finds the plugin through the `jax_plugins` namespace package
    XLA_FLAGS     --xla_gpu_cuda_data_dir=<toolchain>/nvidia/cuda_nvcc   (else /usr/local/cuda's, silently)
    PATH          the pinned ptxas first, for Mosaic GPU and ptxas_report.py
    JAX_PLATFORMS cpu                    the compile is deviceless; no GPU client is opened
    JAX_ENABLE_COMPILATION_CACHE false   a cache hit would skip XLA and so the dump

Use:

    python -m jaxpaged.static_profile.target my_script.py   # runs my_script.py in that environment

    from jaxpaged.static_profile.target import compile_for_h100, spec, specs_like
    from jaxpaged.static_profile.hlo_accounting import account, BufferOverride, entry_param_number
    from jaxpaged.static_profile.thunks import cross_check

    out = compile_for_h100(step, (spec((L, 2, K, P, 16, 128), jnp.bfloat16), specs_like(params), ...),
                           donate_argnums=(0,), dump_dir=True)          # -> H100Compiled
    kv = entry_param_number(out.hlo_text, "kv")                         # jax's name of the argument
    acc = account(out.hlo_text, BufferOverride(kv, bytes_read=live_kv_bytes_per_read))
    acc.num_launches, acc.num_copies, acc.copy_bytes, acc.hbm_bytes, acc.by_kind(), acc.pallas_kernels()
    assert cross_check(acc, out.dump_dir) == []                         # HLO and thunks agree

    python -m jaxpaged.static_profile.ptxas_report DUMP_DIR [--all]

Limits: no autotuning without a GPU (XLA's Triton GEMMs get default tiles; split-K shows as an
extra reduce kernel); a cuBLAS call counts as one launch; a conditional counts its branch with the
most launches, a loop without `known_trip_count` once; Mosaic GPU kernels' PTX is not in XLA's dump
(`MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR`), so ptxas_report.py does not read them.
"""
