"""`whiflash bench`: speed and losslessness of every speculation method on a chat workload.

Modules:
    workload  - Spec-Bench / chat-JSONL prompts, grouped by category
    runners   - one runner per method: the engine in-process, the HTTP gateway, and peers
                (transformers generate, transformers prompt lookup, llama.cpp)
    stats     - per-run results, repeat collapsing, agreement, per-category aggregation
    report    - text / Markdown tables, the PNG chart, machine and git description
    cli       - argument parsing and the interleaved measurement loop
"""
