"""``python -m bench.instructions``: the simulator's instruction count, through its main."""

from __future__ import annotations

import shutil

import pytest

from bench.instructions import Count, main, report


def test_a_short_run_is_counted_net_of_start_up(capsys) -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    main(["--seconds", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cc, 126 agents, 9 nodes, 3 simulated seconds")
    label, requests, instructions, per_request = out[2].rsplit(maxsplit=3)
    assert label == "this checkout"
    assert int(requests) > 0
    net = int(instructions.replace(",", ""))
    # Net of start-up (about 3e9 instructions), a few seconds' play is far less.
    assert 0 < net < 2_000_000_000
    assert abs(int(per_request.replace(",", "")) - net / int(requests)) <= 1


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(SystemExit, match="--seconds must be positive"):
        main(["--seconds", "0"])
    if shutil.which("valgrind") is not None:
        with pytest.raises(SystemExit, match="cannot check out no-such-rev"):
            main(["--against", "no-such-rev"])


def test_the_64_node_run_is_bench_sims_with_its_agents(capsys) -> None:
    counts = [Count("this checkout", 10, 900)]
    assert report(600, counts, 64)[0].startswith("cc, 640 agents, 64 nodes, 600 simulated")
    with pytest.raises(SystemExit):
        main(["--nodes", "10"])
    assert "invalid choice: 10 (choose from 9, 64)" in capsys.readouterr().err


def test_the_ratio_per_request_needs_requests_on_both_sides() -> None:
    both = report(600, [Count("this checkout", 10, 900), Count("HEAD", 12, 1000)])
    assert both[-1] == "ratio 0.9000 (different requests; per request 1.0800)"
    none = report(600, [Count("this checkout", 0, 900), Count("HEAD", 12, 1000)])
    assert none[-1] == "ratio 0.9000 (a run played no request: no ratio per request)"
    assert none[2].split() == ["this", "checkout", "0", "900", "900"]
