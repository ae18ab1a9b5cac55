"""The engine: the step loop and what callers talk to.

    protocol.py         EngineClient: the one interface LLM, the CLI and the server use
    engine.py           LLMEngine: plan -> build inputs -> run -> sample -> commit -> outputs
    output_processor.py detokenizing, stop strings, RequestOutputs
    outputs.py          RequestOutput, CompletionOutput
    beam_search.py      beam search bookkeeping (Hugging Face's semantics)
    data_parallel.py    DataParallelEngine: several engines behind the same interface
    build.py            build_engine: load the model, size the pool, make the engine(s)
"""
