"""The experiments end to end at a micro scale, their ratios, determinism, and the command."""

from __future__ import annotations

import json

import msgspec
import pytest
from micro import MICRO

from evinfra.cli import main
from evinfra.config import load_config
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.report import higher, lower, write
from evinfra.experiments.runs import run_plans
from evinfra.experiments.scale import QUICK


def test_ratios_read_above_one_as_evinfra_better() -> None:
    assert higher(2.0, 1.0) == 2.0 and lower(1.0, 4.0) == 4.0
    assert lower(0.0, 1.0) is None and higher(1.0, 0.0) is None


def swept(plans, template, best: int) -> dict:
    """Outcomes for the sweep runs among ``plans`` (keys ``*-static-{p}P``), ``best`` ahead."""
    out = {}
    for p in plans:
        if "-static-" in p.key:
            prefill = p.config.cluster.initial_prefill
            out[p.key] = msgspec.structs.replace(
                template, key=p.key, system=p.system, initial_split=f"{prefill}P{9 - prefill}D",
                summary=msgspec.structs.replace(template.summary,
                                                throughput=10.0 - abs(prefill - best)))
    return out


# tableD5 runs the baselines' policy twice, evinfra's data plane in one (test_table_d5.py);
# fig5 plays no simulation (test_fig5.py).
# latency runs evinfra's own stack at fixed splits, no baseline (test_latency.py).
@pytest.mark.parametrize("name", sorted(set(EXPERIMENTS) - {"fig2a", "fig2b", "calibration",
                                                             "tableD5", "latency", "fig5"}))
def test_every_experiment_plans_its_paper_systems(name, template) -> None:
    config = load_config("etc/cluster.toml")
    plans = EXPERIMENTS[name].plans(config, QUICK, 1)
    followups = getattr(EXPERIMENTS[name], "followups", None)
    if followups is not None:
        assert followups(config, QUICK, 1, {}) == []  # nothing until the sweep is in
        plans += followups(config, QUICK, 1, swept(plans, template, 4))
    keys = [p.key for p in plans]
    assert len(set(keys)) == len(keys)
    policies = {p.config.policy.name for p in plans}
    assert "evinfra" in policies or "evinfra-fixed" in policies
    assert policies - {"evinfra", "evinfra-fixed"}  # at least one baseline beside it


@pytest.mark.parametrize("name", ["fig3", "fig8", "tableD2", "tableD4"])
def test_comparisons_with_the_best_static_split_run_at_the_sweeps_choice(name, template):
    """Not at the paper's 4P5D: at whichever split this simulator's sweep finds best (a
    control: a sweep that prefers 6P moves them there)."""
    config = load_config("etc/cluster.toml")
    experiment = EXPERIMENTS[name]
    plans = experiment.plans(config, QUICK, 1)
    assert {p.config.cluster.initial_prefill for p in plans if "-static-" in p.key} == {2, 4, 6}
    for best in (2, 6):
        later = experiment.followups(config, QUICK, 1, swept(plans, template, best))
        fixed = [p for p in later if not p.config.planner.adapt]
        assert fixed and {p.config.cluster.initial_prefill for p in later} == {best}


def test_fig6_micro_writes_tables_with_ratios_and_a_plot(tmp_path) -> None:
    config = load_config("etc/cluster.toml")
    runs = run_plans(EXPERIMENTS["fig6"].plans(config, MICRO, 1), jobs=2)
    report, plots = EXPERIMENTS["fig6"].report(runs, MICRO, "etc/cluster.toml", 1)
    files = write(tmp_path, report, plots)
    assert all(f.stat().st_size > 0 for f in files)
    data = json.loads((tmp_path / "results.json").read_text())
    ratios = next(t for t in data["tables"] if t["title"].startswith("evinfra against"))
    assert len(ratios["rows"]) == 9 and all(len(r) == 6 for r in ratios["rows"])
    md = (tmp_path / "results.md").read_text()
    assert "throughput ×" in md and "micro scale" in md and "1.10–2.73×" in md
    queueing = next(t for t in data["tables"] if "Table C.2" in t["title"])
    for row, n in zip(queueing["rows"], (90, 108, 126), strict=True):
        ev, dy = runs[f"cc-{n}-evinfra"].control, runs[f"cc-{n}-dynamo"].control
        assert row[1:5] == [ev.mean_prefill_queueing, dy.mean_prefill_queueing,
                            ev.queueing_imbalance, dy.queueing_imbalance]


def test_outcomes_do_not_depend_on_parallelism(tmp_path) -> None:
    config = load_config("etc/cluster.toml")
    plans = EXPERIMENTS["fig3"].plans(config, MICRO, 3)
    a = run_plans(plans, jobs=1)
    b = run_plans(plans, jobs=2)
    strip = lambda runs: {k: msgspec.structs.replace(v, wall_s=0.0) for k, v in runs.items()}
    assert msgspec.json.encode(strip(a), order="sorted") == \
        msgspec.json.encode(strip(b), order="sorted")


def test_the_command_saves_each_run_and_resumes(tmp_path, capsys) -> None:
    out = tmp_path / "d4"
    args = ["experiment", "tableD4", "--quick", "--out", str(out), "--jobs", "1"]
    # The systems run at the best static split: they exist once the sweep has played.
    assert main(args + ["--only", "thunder*"]) == 2
    assert "matches no run of tableD4 (runs that follow" in capsys.readouterr().err
    assert main(args + ["--only", "cc-static-*"]) == 0
    first = capsys.readouterr().out
    assert "3 to play" in first and "then 2 runs that follow from those: 0 to play" in first
    assert main(args + ["--only", "thunder*"]) == 0
    second = capsys.readouterr().out
    assert "5 runs: 3 done earlier, 1 to play" in second and "not played" in second
    assert main(args) == 0
    third = capsys.readouterr().out
    assert "5 runs: 4 done earlier, 1 to play" in third and "not played" not in third
    assert (out / "runs" / "thunderagent.json").exists()
    assert {"results.json", "results.md", "tableD4.png"} <= {f.name for f in out.iterdir()}
    # A pattern that names no run is a typo, not an empty experiment.
    assert main(args + ["--only", "thunderbolt*"]) == 2
    err = capsys.readouterr().err
    assert "--only 'thunderbolt*' matches no run of tableD4" in err and "thunderagent" in err


def test_fig7_micro_compares_with_dynamo_and_the_best_static_split(tmp_path) -> None:
    config = load_config("etc/cluster.toml")
    plans = EXPERIMENTS["fig7"].plans(config, MICRO, 1)
    assert {p.system for p in plans} == {"evinfra", "dynamo", "static 2P7D", "static 4P5D",
                                         "static 6P3D"}
    runs = run_plans(plans, jobs=2)
    report, plots = EXPERIMENTS["fig7"].report(runs, MICRO, "etc/cluster.toml", 1)
    write(tmp_path, report, plots)
    data = json.loads((tmp_path / "results.json").read_text())
    ratios = next(t for t in data["tables"] if t["title"].startswith("evinfra against"))
    assert [r[0] for r in ratios["rows"]][0] == "dynamo"
    assert ratios["rows"][1][0].startswith("best static (static ")
    assert all(isinstance(x, float) for r in ratios["rows"] for x in r[1:3])
    periods = next(t for t in data["tables"] if t["title"].startswith("Throughput per period"))
    assert [r[0] for r in periods["rows"]] == ["putnam", "mixed", "osworld"]


def test_fig2a_sweeps_every_split_and_judges_the_best_against_the_paper(tmp_path) -> None:
    from evinfra.experiments.scale import FULL

    config = load_config("etc/cluster.toml")
    plans = EXPERIMENTS["fig2a"].plans(config, FULL, 1)
    assert [p.key for p in plans[:8]] == [f"putnam-224-static-{p}P" for p in range(1, 9)]
    assert len(plans) == 24 and {p.config.policy.name for p in plans} == {"static-sglang"}
    micro = msgspec.structs.replace(MICRO, sweep=(2,))
    runs = run_plans(EXPERIMENTS["fig2a"].plans(config, micro, 1), jobs=2)
    template = next(iter(runs.values()))

    def outcomes(best: dict[str, int]) -> dict:
        out = {}
        for w, n in (("putnam", 224), ("cc", 90), ("osworld", 128)):
            for p in range(1, 9):
                summary = msgspec.structs.replace(template.summary,
                                                  throughput=10.0 - abs(p - best[w]))
                out[f"{w}-{n}-static-{p}P"] = msgspec.structs.replace(
                    template, key=f"{w}-{n}-static-{p}P", system=f"static {p}P{9 - p}D",
                    summary=summary)
        return out

    report, plots = EXPERIMENTS["fig2a"].report(outcomes({"putnam": 1, "cc": 3, "osworld": 7}),
                                                FULL, "etc/cluster.toml", 1)
    assert report.notes[0].startswith("Best splits 1P / 3P / 7P") and ": as in" in report.notes[0]
    best = next(t for t in report.tables if t.title == "Best split per workload")
    assert [r[2] for r in best.rows] == ["static 1P8D", "static 3P6D", "static 7P2D"]
    report, _ = EXPERIMENTS["fig2a"].report(outcomes({"putnam": 4, "cc": 3, "osworld": 7}),
                                            FULL, "etc/cluster.toml", 1)
    assert "NOT as in the paper" in report.notes[0]
    files = write(tmp_path, report, plots)
    assert all(f.stat().st_size > 0 for f in files)


def test_fig8_micro_breaks_lost_reuse_down_by_the_wait(tmp_path) -> None:
    config = load_config("etc/cluster.toml")
    # Eight agents rather than MICRO's three: enough for peers to fetch (table (e)).
    micro = msgspec.structs.replace(MICRO, sweep=(4,), agents=1 / 16)
    runs = run_plans([p for p in EXPERIMENTS["fig8"].plans(config, micro, 1)
                      if p.key == "cc-static-4P"], jobs=1)
    runs.update(run_plans([p for p in EXPERIMENTS["fig8"].followups(config, micro, 1, runs)
                           if p.key in ("ablation-0", "ablation-1")], jobs=2))
    report, plots = EXPERIMENTS["fig8"].report(runs, micro, "etc/cluster.toml", 1)
    write(tmp_path, report, plots)
    data = json.loads((tmp_path / "results.json").read_text())
    waits = next(t for t in data["tables"] if t["title"].startswith("(d) Lost KV reuse"))
    assert [r[0] for r in waits["rows"]] == ["static 4P5D", "evinfra, fixed 4P5D",
                                             "- counts (LRU)"]
    for row, key in zip(waits["rows"], ("cc-static-4P", "ablation-0", "ablation-1")):
        by = runs[key].summary.reuse_by_wait
        assert row[1:3] == [pytest.approx(100 * by[w].lost_kv_reuse) if w in by else None
                            for w in ("first", "<10s")]
    assert "(d) Lost KV reuse (%) by the wait" in (tmp_path / "results.md").read_text()
    fetches = next(t for t in data["tables"] if t["title"].startswith("(e) Peer fetches"))
    bins = runs["ablation-0"].fetches
    assert bins and [r[1] for r in fetches["rows"]] == [b.count for b in bins]
    assert all(r[4] == pytest.approx(1e3 * b.fetch_p50) for r, b in zip(fetches["rows"], bins))


def test_calibration_plays_only_baselines_and_scores_each_figure_against_the_paper(template):
    """evinfra is never a calibration target; each row's error is |ours − paper| / paper,
    and a different outcome gives a different error (the control)."""
    from evinfra.experiments.calibration import PAPER_C1, relative_error

    config = load_config("etc/cluster.toml")
    plans = EXPERIMENTS["calibration"].plans(config, QUICK, 1)
    assert not {p.config.policy.name for p in plans} & {"evinfra", "evinfra-fixed"}
    assert {f"dynamo-{w}-{n}" for w, n in PAPER_C1} <= {p.key for p in plans}
    runs = swept([p for p in plans if p.key.startswith("cc-90-")], template, 4)
    dynamo = msgspec.structs.replace(template, key="dynamo-cc-90", summary=msgspec.structs.replace(
        template.summary, kv_hit_rate=0.9225 * 1.1))
    runs["dynamo-cc-90"] = dynamo
    report, _ = EXPERIMENTS["calibration"].report(runs, QUICK, "etc/cluster.toml", 1)
    rows = {r[1]: r for r in report.tables[0].rows}
    best = rows["best static split of SGLang PD, cc 90 (prefill nodes)"]
    assert best[3] == 4.0 and best[4] == 0.0 and best[5] == "yes"
    hit = rows["Dynamo KV hit rate (%), cc 90"]
    assert hit[2] == 92.25 and hit[4] == pytest.approx(10.0) and hit[5] == "yes"
    assert rows["Dynamo KV hit rate (%), cc 108"][5] == "–"  # not played
    assert relative_error(92.25 * 1.3, 92.25) == pytest.approx(0.3)
    # D.6: the upstream run's prefill idle share, which tableD5's upstream run also plays.
    d6 = next(p for p in plans if p.key == "d6-upstream-sglang")
    assert d6.config.policy.peer_fetch == "prefill-start"
    up = next(p for p in EXPERIMENTS["tableD5"].plans(config, QUICK, 1)
              if p.key == "upstream-sglang")
    label = lambda spec: msgspec.structs.replace(spec, label="")  # noqa: E731
    assert (d6.config, label(d6.spec)) == (up.config, label(up.spec))
    idle = "prefill idle GPU time under upstream SGLang (%), 4P5D, CC 126"
    assert rows[idle][3] is None
    runs["d6-upstream-sglang"] = msgspec.structs.replace(
        template, key="d6-upstream-sglang", extras={"prefill_idle_share": 0.118})
    report, _ = EXPERIMENTS["calibration"].report(runs, QUICK, "etc/cluster.toml", 1)
    row = {r[1]: r for r in report.tables[0].rows}[idle]
    assert row[3] == pytest.approx(11.8) and row[4] == pytest.approx(50.0) and row[5] == "no"
    assert "P95 TTFT (s), sticky sessions at 4P5D, CC 90" in rows
    runs = swept([p for p in plans if p.key.startswith("cc-90-")], template, 6)
    report, _ = EXPERIMENTS["calibration"].report(runs, QUICK, "etc/cluster.toml", 1)
    rows = {r[1]: r for r in report.tables[0].rows}
    assert rows["best static split of SGLang PD, cc 90 (prefill nodes)"][4] == pytest.approx(50.0)
    assert rows["best static split of SGLang PD, cc 90 (prefill nodes)"][5] == "no"
    # Table D.1: the sweep's best static throughput against SGLang's 8.81 / 0.98 req/s
    # (Putnam) from the sweep's best run; unplayed without the sweep.
    d1 = "best static split's throughput, putnam 224 (req/s)"
    assert rows[d1][2] == pytest.approx(8.99, abs=0.01) and rows[d1][3] is None
    paper = 8.81 / 0.98
    for factor in (1.0, 0.5):  # the second is the control: a slower sweep, another error
        runs = {k: msgspec.structs.replace(o, summary=msgspec.structs.replace(
                    o.summary, throughput=factor * o.summary.throughput))
                for k, o in swept([p for p in plans if p.key.startswith("putnam-224-")],
                                  template, 2).items()}
        report, _ = EXPERIMENTS["calibration"].report(runs, QUICK, "etc/cluster.toml", 1)
        row = {r[1]: r for r in report.tables[0].rows}[d1]
        assert row[3] == 10.0 * factor
        assert row[4] == pytest.approx(100 * abs(10.0 * factor - paper) / paper)


def test_fig2b_finds_the_best_split_of_each_window_and_the_static_splits_loss(template):
    """Made-up sweep outcomes whose best split moves 2P -> 4P -> 6P over the three periods;
    4P is best over the whole run and loses in the first and last (a control: a flat sweep
    loses nothing)."""
    from evinfra.experiments.fig7 import windows as shift_windows

    config = load_config("etc/cluster.toml")
    plans = EXPERIMENTS["fig2b"].plans(config, QUICK, 1)
    windows = shift_windows(QUICK)
    assert [p.key for p in plans] == ["shift-static-2P", "shift-static-4P", "shift-static-6P"]
    assert all(p.periods[3:] == windows for p in plans) and len(windows) == 3
    # fig. 7's static runs are these runs (its saved outcomes serve fig2b); a control:
    # another seed's are not.
    fig7 = {p.key: p.digest for p in EXPERIMENTS["fig7"].plans(config, QUICK, 1)}
    assert all(fig7[p.key] == p.digest for p in plans)
    assert all(p.digest not in fig7.values() for p in EXPERIMENTS["fig2b"].plans(config, QUICK, 2))

    def outcomes(best_of):
        out = {}
        for p in (2, 4, 6):
            periods = {name: msgspec.structs.replace(
                template.summary, throughput=10.0 - abs(p - best_of(name)) - (p != 4) * 0.5)
                for name, _, _ in windows}
            out[f"shift-static-{p}P"] = msgspec.structs.replace(
                template, key=f"shift-static-{p}P", system=f"static {p}P{9 - p}D",
                periods=periods, summary=msgspec.structs.replace(
                    template.summary, throughput=10.0 - (p != 4)))
        return out

    moving = {"putnam-0": 2, "mixed-0": 4, "osworld-0": 6}
    report, _ = EXPERIMENTS["fig2b"].report(outcomes(moving.get), QUICK, "etc/cluster.toml", 1)
    rows = report.tables[0].rows
    assert [r[2] for r in rows] == ["2P", "4P", "6P"]
    assert rows[0][5] == pytest.approx(100 * (1 - 8.0 / 9.5)) and rows[1][5] == 0.0
    paper = {r[0]: r[1] for r in report.tables[1].rows}
    assert paper["best static split (whole run)"] == "4P5D"
    assert paper["its largest loss, Putnam and OSWorld periods (%)"] == pytest.approx(
        100 * (1 - 8.0 / 9.5))
    flat, _ = EXPERIMENTS["fig2b"].report(outcomes(lambda name: 4), QUICK, "etc/cluster.toml", 1)
    assert {r[2] for r in flat.tables[0].rows} == {"4P"} and all(
        r[5] == 0.0 for r in flat.tables[0].rows)


def test_table_d1_sweeps_both_engines_and_names_each_best_split(template):
    config = load_config("etc/cluster.toml")
    plans = EXPERIMENTS["tableD1"].plans(config, QUICK, 1)
    assert len(plans) == 3 * 2 * 3
    assert {p.config.policy.name for p in plans} == {"static-sglang", "evinfra-fixed"}
    assert all(not p.config.planner.adapt for p in plans)
    runs = {}
    for prefix, best in (("cc-sglang", 4), ("cc-symmetric", 6)):
        runs.update(swept([p for p in plans if p.key.startswith(prefix)], template, best))
    report, _ = EXPERIMENTS["tableD1"].report(runs, QUICK, "etc/cluster.toml", 1)
    rows = {(r[0], r[2]): r for r in report.tables[0].rows}
    assert rows[("cc", "sglang")][3] == "4P5D" and rows[("cc", "sglang")][7] == "yes"
    assert rows[("cc", "symmetric")][3] == "6P3D" and rows[("cc", "symmetric")][7] == "no"


def test_a_field_added_at_its_default_keeps_the_saved_digests() -> None:
    """A config that gains a field whose default keeps the old behaviour must not replay
    every saved run; setting that field (the control) must."""
    from evinfra.experiments.runs import _set

    old = msgspec.defstruct("Part", [("x", int, 1)])
    new = msgspec.defstruct("Part", [("x", int, 1), ("y", float, 0.5)])
    assert _set(old(x=2)) == _set(new(x=2)) == {"x": 2}
    assert _set(new(x=2, y=0.7)) != _set(old(x=2))
    config = load_config("etc/cluster.toml")
    plan = EXPERIMENTS["fig6"].plans(config, QUICK, 1)[0]
    same = msgspec.structs.replace(plan, config=msgspec.structs.replace(
        plan.config, planner=msgspec.structs.replace(plan.config.planner,
                                                     ttft_target_s=None)))
    moved = msgspec.structs.replace(plan, config=msgspec.structs.replace(
        plan.config, planner=msgspec.structs.replace(plan.config.planner,
                                                     ttft_target_s=5.0)))
    assert same.digest == plan.digest != moved.digest


def test_osworld_and_the_shift_run_serve_kimi_k26_the_others_glm52() -> None:
    """Paper 6.1: K2.6 for OSWorld and the shifting run; its prefill and KV differ from
    GLM-5.2's (drivers/fake/models.py), the decode and memory do not."""
    config = load_config("etc/cluster.toml")
    glm = config.fake
    plans = (EXPERIMENTS["tableD1"].plans(config, QUICK, 1)
             + EXPERIMENTS["fig7"].plans(config, QUICK, 1))
    for p in plans:
        fake = p.config.fake
        if "osworld" in p.workloads:
            assert fake.c2 == pytest.approx(4 * glm.c2) and fake.c1 == pytest.approx(0.8 * glm.c1)
            assert fake.fetch_s_per_token == pytest.approx(glm.fetch_s_per_token * 35.136 / 54.6)
        else:
            assert fake == glm
        assert (fake.d0, fake.d1, fake.d2, fake.l1_tokens) == (glm.d0, glm.d1, glm.d2,
                                                                glm.l1_tokens)
    assert {p.workloads[0] for p in plans} == {"cc", "putnam", "osworld"}
    assert any(p.workloads == ["osworld", "putnam"] for p in plans)


def test_an_unknown_model_is_refused_by_name() -> None:
    from evinfra.drivers.fake.models import serving

    with pytest.raises(ValueError, match="unknown model 'gpt'.*kimi-k2.6"):
        serving(load_config("etc/cluster.toml").fake, "gpt")
