"""Benchmarking (mirror of trtllm-bench): datasets, the request driver, metrics, report, sweep, roofline,
peers and plots, and the shipped model's evaluation (its held-out prompts in `eval_sets`, exact-match
`scoring`). See `cli/bench.py`, `cli/sweep.py` and `cli/prepare_dataset.py` for the commands."""
from mtp_core.bench.dataset import BenchRequest, encode_request, load_dataset, write_dataset
from mtp_core.bench.metrics import RequestRecord, percentile, percentile_stats
from mtp_core.bench.report import build_report, format_report
from mtp_core.bench.runner import run_requests

__all__ = ["BenchRequest", "RequestRecord", "build_report", "encode_request", "format_report", "load_dataset",
           "percentile", "percentile_stats", "run_requests", "write_dataset"]
