"""What users call: `LLM` (llm.py), the command line (cli.py), the OpenAI server (serve/)."""
