"""bench/scorecard.py reads the side tables that bench/throughput.py prints (llama.cpp or mlx-lm
against one column per cpu_weights mode): what one prints, the other parses back."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        import scorecard
        import throughput

        yield throughput, scorecard
    finally:
        sys.path.remove(str(BENCH))
        for name in ("scorecard", "throughput"):  # plain names: leave none behind for another test
            sys.modules.pop(name, None)


def test_a_printed_side_table_parses_back(bench_modules, capsys):
    throughput, scorecard = bench_modules
    rows = [("solo", "Llama.generate", {"llama.cpp": 66.04, "fp32": 33.0, "int8-dot": 70.0}),
            ("c16", "llama_batch, 16 sequence ids", {"llama.cpp": 112.1, "fp32": 224.5})]
    print("cpu_weights=int8-dot: skipped, the installed mlxq does not have it")
    throughput.print_sides(rows, "llama.cpp", ["fp32", "int8-dot"], "llama.cpp API")
    print("tok/s: a line after the table")
    text = capsys.readouterr().out
    [table] = scorecard.side_tables([text], "llama.cpp")
    assert table == {("solo", "fp32"): ("66.0", "33.0", "0.50"), ("solo", "int8-dot"): ("66.0", "70.0", "1.06"),
                     ("c16", "fp32"): ("112.1", "224.5", "2.00"), ("c16", "int8-dot"): ("112.1", "-", "-")}
    assert scorecard.side_tables([text], "mlx-lm") == []
