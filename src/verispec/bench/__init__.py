"""`verispec bench`: prompt sets, timed runs, metrics, peers, JSON + Markdown + PNG reports.

prompts.py  prompt sets from installed packages, chat formatting -> token ids
runner.py   methods (plain, each drafter, each mode), interleaved single-stream runs, load sweep
peers.py    transformers generate (plain, prompt lookup) and llama.cpp on the same prompts
metrics.py  traces -> numbers, with the definitions printed in every report
report.py   the report dict, console and Markdown tables, files
plots.py    PNG plots
cli.py      the `bench` subcommand
"""
