"""`verispec bench`: timed runs, metrics, peers, JSON + Markdown + PNG reports.

runner.py   methods (plain, each drafter, each mode), interleaved single-stream runs, in-process load sweep
server_sweep.py  the load sweep through `verispec serve` processes over HTTP
sampled.py  the sampled-output distribution check on a subsample (verispec.distcheck)
peers.py    transformers generate (plain, prompt lookup, assisted) and llama.cpp (plain, prompt lookup)
metrics.py  traces -> numbers, with the definitions printed in every report
report.py   the report dict, console and Markdown tables, files
plots.py    PNG plots
cli.py      the `bench` subcommand

The prompt sets (MT-Bench, HumanEval, ShareGPT) are in `verispec.prompts`, shared with `verispec data`.
"""
