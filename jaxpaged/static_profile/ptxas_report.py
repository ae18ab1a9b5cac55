"""Registers, spills, shared memory and occupancy of the Pallas (Triton) kernels of a compiled
program, from the PTX in its XLA dump, assembled for sm_90a with the pinned ptxas.

    python -m jaxpaged.static_profile.ptxas_report DUMP_DIR [--all]    # --all: every kernel, not just Pallas

Runs in the normal environment (it needs ptxas from the toolchain dir, not the jax plugin).
Sources, per kernel:
  registers, spills, static smem   `ptxas -arch=sm_90a -v` on the PTX module holding `.entry NAME(`
  threads per block                 the PTX's `.reqntid` / `.maxntid`, else the thunk's `threads:`
  dynamic smem                      the thunk's `shared_memory:` (Triton allocates it at launch)
  wgmma / TMA / mma.sync / cp.async instructions present in that entry's PTX
Occupancy is the theoretical one (the CUDA occupancy calculator's arithmetic) against the H100
limits in target.py: resident blocks per SM = min(block limit, warp limit, register limit, smem
limit), occupancy = resident warps / 64. An estimate: it says nothing of latency hiding.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile

from jaxpaged.static_profile.hlo_accounting import account
from jaxpaged.static_profile.target import H100, H100Target, toolchain_dir
from jaxpaged.static_profile.thunks import (count_thunks, find_dump_files, parse_thunk_metadata, parse_thunk_sequence,
                                            read_text)

_FEATURES = {"wgmma": r"\bwgmma\.mma_async", "tma": r"\bcp\.async\.bulk\.tensor", "mma_sync": r"\bmma\.sync",
             "cp_async": r"\bcp\.async\.(?:ca|cg)\b"}


@dataclasses.dataclass(frozen=True)
class KernelReport:
    hlo_name: str
    kernel: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    static_smem: int
    dynamic_smem: int
    threads_per_block: int
    blocks_per_sm: int
    occupancy: float  # resident warps / max warps per SM
    limiter: str  # blocks | warps | registers | smem
    features: tuple[str, ...]  # of wgmma, tma, mma_sync, cp_async


def ptxas_path() -> str:
    path = toolchain_dir() / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    if not path.exists():
        raise FileNotFoundError(f"no pinned ptxas at {path}; run scripts/install_h100_toolchain.sh")
    return str(path)


def ptxas_info(ptx_path: str, ptxas: str | None = None) -> dict[str, dict[str, int]]:
    """Per entry function of one PTX module: registers, spill/stack bytes, static smem."""
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([ptxas or ptxas_path(), "-arch=sm_90a", "-v", ptx_path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_path}:\n{run.stderr[-2000:]}")
    info: dict[str, dict[str, int]] = {}
    current = None
    for line in (run.stdout + run.stderr).splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = info.setdefault(m.group(1), {"registers": 0, "spill_store_bytes": 0, "spill_load_bytes": 0,
                                                   "stack_bytes": 0, "static_smem": 0})
            continue
        if current is None:
            continue
        for key, pattern in (("stack_bytes", r"(\d+) bytes stack frame"), ("spill_store_bytes", r"(\d+) bytes spill stores"),
                             ("spill_load_bytes", r"(\d+) bytes spill loads"), ("registers", r"Used (\d+) registers"),
                             ("static_smem", r"(\d+) bytes smem")):
            m = re.search(pattern, line)
            if m:
                current[key] = int(m.group(1))
    return info


def entry_ptx(ptx_text: str, name: str) -> str:
    """The text of entry `name` in a PTX module (from its `.entry` line to the next one)."""
    start = ptx_text.find(f".entry {name}(")
    if start < 0:
        raise ValueError(f"no .entry {name}( in this PTX")
    nxt = ptx_text.find(".entry ", start + 1)
    return ptx_text[start:nxt if nxt > 0 else len(ptx_text)]


def occupancy(registers: int, smem_bytes: int, threads: int, target: H100Target = H100) -> tuple[int, float, str]:
    """(resident blocks per SM, occupancy, the limiting resource) for one kernel."""
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // target.register_alloc_unit) * target.register_alloc_unit
    smem_per_block = -(-(smem_bytes + target.smem_reserved_per_block) // target.smem_alloc_unit) * target.smem_alloc_unit
    limits = {
        "blocks": target.max_blocks_per_sm,
        "warps": target.max_warps_per_sm // warps,
        "registers": (target.registers_per_sm // regs_per_warp) // warps if regs_per_warp else target.max_blocks_per_sm,
        "smem": target.smem_per_sm // smem_per_block,
    }
    limiter = min(limits, key=limits.get)
    blocks = limits[limiter]
    return blocks, blocks * warps / target.max_warps_per_sm, limiter


def report(dump_dir: str, all_kernels: bool = False) -> list[KernelReport]:
    files = find_dump_files(dump_dir)
    hlo = read_text(files.hlo)
    thunks = count_thunks(parse_thunk_sequence(read_text(files.thunk_sequence)),
                          parse_thunk_metadata(read_text(files.thunk_metadata)), hlo)
    wanted = set(thunks.kernel_launch_dims) if all_kernels else {l.name for l in account(hlo).pallas_kernels()}
    ptx = {path: read_text(path) for path in files.ptx}
    infos: dict[str, dict] = {}
    out = []
    for hlo_name in sorted(wanted):
        if hlo_name not in thunks.kernel_launch_dims:
            raise ValueError(f"{hlo_name} has no kernel thunk in {files.thunk_sequence}")
        kernel, _grid, threads, dynamic_smem = thunks.kernel_launch_dims[hlo_name]
        path = next((p for p, text in ptx.items() if f".entry {kernel}(" in text), None)
        if path is None:
            continue  # cuBLAS and other library calls have no PTX of ours
        if path not in infos:
            infos[path] = ptxas_info(path)
        body = entry_ptx(ptx[path], kernel)
        ntid = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", body)
        n_threads = 1
        for d in (ntid.groups() if ntid else threads):
            n_threads *= int(d or 1)
        i = infos[path][kernel]
        blocks, occ, limiter = occupancy(i["registers"], i["static_smem"] + dynamic_smem, n_threads)
        features = tuple(f for f, pattern in _FEATURES.items() if re.search(pattern, body))
        out.append(KernelReport(hlo_name, kernel, i["registers"], i["spill_store_bytes"], i["spill_load_bytes"],
                                i["stack_bytes"], i["static_smem"], dynamic_smem, n_threads, blocks, occ, limiter,
                                features))
    return out


def format_table(reports: list[KernelReport]) -> str:
    rows = [(f"{'kernel':<32} {'regs':>5} {'spill B':>8} {'smem B':>8} {'threads':>7} {'blk/SM':>6} "
             f"{'occup.':>6} {'limit':<9} features")]
    for r in reports:
        rows.append(f"{r.kernel[:32]:<32} {r.registers:>5} {r.spill_store_bytes + r.spill_load_bytes:>8} "
                    f"{r.static_smem + r.dynamic_smem:>8} {r.threads_per_block:>7} {r.blocks_per_sm:>6} "
                    f"{r.occupancy:>6.1%} {r.limiter:<9} {','.join(r.features) or '-'}")
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump_dir")
    parser.add_argument("--all", action="store_true", help="every kernel with PTX, not only Pallas ones")
    ns = parser.parse_args()
    print(format_table(report(ns.dump_dir, ns.all)))
