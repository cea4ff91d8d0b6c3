"""benchmarks_common.profile_summary, which turns py-spy's collapsed stacks into each kind of process's
busy share and hot functions (serving.py --py-spy prints it)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from benchmarks_common import profile_summary  # noqa: E402

# Two API servers and a core under the benchmark's process; a command line with a newline in it, as
# `python -c` gives; line numbers that differ for the same function.
STACKS = """\
process 1:"python serving.py";process 2:"python -m headrace.frontend.api.server --core x";main (server.py:10);send (h11.py:5) 30
process 1:"python serving.py";process 2:"python -m headrace.frontend.api.server --core x";main (server.py:10);encode (app.py:7) 10
process 1:"python serving.py";process 3:"python -m headrace.frontend.api.server --core y";main (server.py:12);send (h11.py:6) 20
process 1:"python serving.py";process 4:"python -m headrace.frontend.cli core --model m";step (engine.py:3) 80
process 1:"python serving.py";process 5:"python -c import x
print(1)";<module> (<string>:1) 5
"""


def test_profile_summary_groups_processes_by_kind(tmp_path):
    path = tmp_path / "stacks.txt"
    path.write_text(STACKS)
    lines = profile_summary(str(path), samples_per_process=100)
    assert lines[0] == "engine core: 1 process(es), busy 80% each on average, 80 samples"
    at = lines.index("API server: 2 process(es), busy 30% each on average, 60 samples")
    api = lines[at + 1:at + 6]
    # send ended 50 of the 60 samples (two line numbers, two processes), encode 10; main holds every
    # sample, so it is left out of "within"
    assert api[0].split() == ["self", "83.3%", "send", "(h11.py)"]
    assert api[1].split() == ["self", "16.7%", "encode", "(app.py)"]
    assert [line.split()[2] for line in api[2:4]] == ["send", "encode"] and "main" not in " ".join(api)
    assert "benchmark: 1 process(es), busy 5% each on average, 5 samples" in lines
