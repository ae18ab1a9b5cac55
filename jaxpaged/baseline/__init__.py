"""What jaxpaged is measured against, and how: the parts of the benchmarks the tests check.

    dense_kv.py        the dense-cache baseline: the design PagedAttention replaced (a contiguous KV
                       region per sequence, static batches), built as fast as that design can be
    measure.py         what every benchmark reports (throughput, TTFT, KV waste, host share,
                       compilations), computed the same way for every system
    drivers.py         jaxpaged's engine and the dense baseline run over the same requests, step by step
    peer_workloads.py  the requests fed to real vLLM and jaxpaged alike, and the greedy cross-checks

The scripts that run them, and the peers that need other environments (Hugging Face, vLLM), are in
benchmarks/ (see its README); BENCHMARKS.md is the protocol.
"""
