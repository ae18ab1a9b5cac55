"""The CI gate's measurement: the engine's decode step for a 2-layer model with Qwen3-0.6B's widths,
batch 64, context 1024, bf16, compiled for an H100 with both Pallas backends, and the smallest bucket
(max_num_seqs=1: one sequence, one row), and a tensor-parallel step: 2 layers of Llama-3-8B over 2
virtual H100s, batch 64, context 2048. Prints one JSON line.

Run in the H100 environment: `python -m jaxpaged.static_profile.target -m jaxpaged.static_profile.gate`
(tests/test_h100_static_gate.py does, and holds the budgets).
"""

import json

from jaxpaged.static_profile.step_profile import StepCase, profile

GATE_CASES = {backend: StepCase("qwen3-0.6b", backend, "auto", num_seqs=64, context=1024, num_layers=2)
              for backend in ("pallas", "mosaic")}
GATE_CASES["one-row"] = StepCase("qwen3-0.6b", "pallas", "auto", num_seqs=1, context=1024, num_layers=2, max_num_seqs=1)
GATE_CASES["tp2"] = StepCase("llama3-8b", "pallas", "auto", num_seqs=64, context=2048, num_layers=2, tp=2)

if __name__ == "__main__":
    rows = [dict(profile(case), gate_case=name) for name, case in GATE_CASES.items()]
    print(json.dumps(rows))
