"""
The benchmark behind `python -m prefill_buckets bench`. Nothing in the library imports it.

- `strategies.py`: the ways to run the workload, and which run uses which;
- `workload.py`: the prompts, tokenized;
- `worker.py`: one strategy in its own process;
- `report.py`: the figures, the table and the plot;
- `command.py`: the command: checks what it needs, runs each strategy's process, writes the report.
"""

from .command import BENCH_HELP, add_arguments, bench, missing_requirements, strategy_list
from .report import format_table, percentile, summarize
from .strategies import DEFAULT_STRATEGIES, QUICK_STRATEGIES, STRATEGIES, Strategy
from .workload import QUICK_LENGTHS, load_prompts


__all__ = [
    "BENCH_HELP",
    "DEFAULT_STRATEGIES",
    "QUICK_LENGTHS",
    "QUICK_STRATEGIES",
    "STRATEGIES",
    "Strategy",
    "add_arguments",
    "bench",
    "format_table",
    "load_prompts",
    "missing_requirements",
    "percentile",
    "strategy_list",
    "summarize",
]
