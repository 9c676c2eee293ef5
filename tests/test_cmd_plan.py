"""`mirrorckpt plan`: the seeds' worked examples through the CLI, and the goodput model's properties
(checked against an event-by-event simulation of the same timeline)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from mirrorckpt.parser import lossmodel
from mirrorckpt.tools import goodput as gp
from mirrorckpt.tools import planner
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.progress import Progress

EXAMPLE_JOB = Path(__file__).resolve().parents[1] / "config" / "example.toml"


def plan(*args, code=0):
    res = CliRunner().invoke(main, ["plan", *map(str, args)])
    assert res.exit_code == code, (res.output, res.exception)
    return res


def plan_json(*args):
    return json.loads(plan(*args, "--json").stdout)


# -- the seeds' worked examples ---------------------------------------------------------------


@pytest.mark.parametrize("C,interval_min,waste_pct", [(90, "23.24", "12.52"), (4, "4.90", "2.70")])
def test_textbook_sync_vs_async_at_3h(C, interval_min, waste_pct):
    # textbook Output 18.2.2: C = 90 s and 4 s, MTBF 3 h, waste C/(tau+C) + tau/(2 MTBF)
    r = plan_json("--checkpoint-seconds", C, "--mtbf-hours", 3)
    s = r["strategies"]["synchronous"]
    assert f"{s['interval_min']:.2f}" == interval_min
    assert f"{100 * s['waste_first_order']['total']:.2f}" == waste_pct
    assert s["used"]["sync_stall_s"] == {"value": C, "source": "given"}
    assert r["inputs"]["sync_stall_s"]["option"] == "--checkpoint-seconds"
    # the exact expectation agrees to first order and is a little kinder (failures also hit stalls)
    assert s["goodput"] == pytest.approx(1 - s["waste_first_order"]["total"], abs=0.003)
    text = plan("--checkpoint-seconds", C, "--mtbf-hours", 3).stdout
    assert f"{interval_min} min" in text and f"{waste_pct}%" in text


def test_guide_20s_stall_at_30min():
    s = plan_json("--checkpoint-seconds", 20, "--mtbf-hours", 0.5)["strategies"]["synchronous"]
    assert round(s["interval_s"]) == 268  # sqrt(2 * 20 * 1800)
    assert s["interval_reason"] == "Young/Daly"


def test_missing_inputs_are_named():
    r = plan_json("--mtbf-hours", 3)
    for name, s in r["strategies"].items():
        assert s["available"] is False and s["missing"], name
    assert "--step-seconds" in r["strategies"]["mirror"]["missing"]
    plan("--mtbf-hours", 3, "--mirrors", 4, "--ranks", 3, code=2)
    plan("--mtbf-hours", 3, "--params", "seven", code=2)
    plan("--mtbf-hours", 0, code=2)


# -- checkpoint size ----------------------------------------------------------------------------


@pytest.mark.parametrize("precision,optimizer,total", [
    ("bf16", "adam", 14), ("fp16", "adamw", 14), ("fp32", "adam", 12), ("fp32", "adam-amsgrad", 16),
    ("bf16", "sgd-momentum", 10), ("fp32", "sgd", 4)])
def test_bytes_per_param(precision, optimizer, total):
    b = gp.checkpoint_bytes_per_param(precision, optimizer)
    assert b["total"] == total == sum(b["components"].values())


def test_size_from_params_and_job_file():
    c = plan_json("--params", "7B", "--mtbf-hours", 3)["checkpoint"]
    assert c["checkpoint_bytes"] == 7e9 * 14 and c["gradient_bytes"] == 7e9 * 2
    assert plan_json("--params", "350M", "--precision", "fp32", "--mtbf-hours", 3)["checkpoint"][
        "checkpoint_bytes"] == 350e6 * 12
    r = plan_json("--job", EXAMPLE_JOB, "--mtbf-hours", 1, "--step-seconds", 0.5, "--mirror-loss", 1e-3)
    c = r["checkpoint"]
    assert c["params"] == 128 * 64 + 128 and c["precision"] == "fp32" and c["optimizer"] == "adamw"
    fb = r["strategies"]["mirror"]["fallback"]
    assert fb["streams"] == [[0, "egress"], [1, "egress"]] and fb["ranks"] == 3
    K = math.ceil(c["gradient_bytes"] / 4096)
    assert fb["probability_per_iteration"] == pytest.approx(
        lossmodel.fail_probability(1e-3, lossmodel.copies(3, [(0, "egress"), (1, "egress")]), K))
    assert r["inputs"]["params"]["source"] == "job file example.toml"


def test_measured_costs_from_the_stall_benchmark(tmp_path):
    ms = lambda x: {"median_ms": x, "min_ms": x, "max_ms": x, "n": 3}  # noqa: E731
    stall = {"job": {"params": 1_000_000, "state_MB": 12.0}, "none": {"step": ms(50.0)},
             "torch.save": {"stall": ms(120.0)}, "dcp.async_save": {"stall": ms(30.0)},
             "mirror": {"link_per_step_ms": 2.0}, "restore": {"memory": ms(60.0), "disk": ms(40.0)},
             "gockpt_k1": {"parts": 1, "step_excess": ms(20.0)}, "gockpt_k7": {"parts": 7, "step_excess": ms(70.0)}}
    f = tmp_path / "BENCHMARKS.json"
    f.write_text(json.dumps({"machine": {"date": "2026-01-01T00:00:00", "cpu": "X"}, "results": {"stall": stall}}))
    r = plan_json("--measured", f, "--mtbf-hours", 1)
    st = r["strategies"]
    assert r["checkpoint"]["params"] == 1e6 and r["checkpoint"]["checkpoint_bytes"] == 12e6
    assert st["synchronous"]["stall_s"] == 0.12 and st["asynchronous"]["stall_s"] == 0.03
    assert st["asynchronous"]["restorable_lag_s"] == pytest.approx(0.12)  # the write at torch.save's rate
    assert st["gockpt"]["stall_s"] == 0.07 and st["gockpt"]["steps"] == 7
    assert st["mirror"]["stall_s"] == pytest.approx(0.002, rel=1e-3) and st["mirror"]["interval_s"] == 0.05
    assert st["mirror"]["load_s"] == pytest.approx(0.06) and st["synchronous"]["load_s"] == pytest.approx(0.04)
    assert r["inputs"]["write_GBps"]["source"].startswith("measured: BENCHMARKS.json stall section, 2026-01-01")
    # with a size of its own, only the bandwidths carry over
    big = plan_json("--measured", f, "--mtbf-hours", 1, "--params", "1B", "--precision", "fp32")["strategies"]
    assert big["synchronous"]["stall_s"] == pytest.approx(1e9 * 12 / 0.1e9 + 1e9 * 12 / 0.4e9)
    assert big["mirror"]["missing"] == ["--step-seconds"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": {"stall": {"error": "RuntimeError: x"}}}))
    assert "no usable stall benchmark" in plan("--measured", bad, "--mtbf-hours", 1, code=2).output


# -- the model ----------------------------------------------------------------------------------


def test_young_interval_is_near_the_optimum():
    # the textbook's waste C/(tau+C) + tau/(2M) is least at tau + C = sqrt(2 C M); Young's
    # sqrt(2 C M) (C/tau in place of C/(tau+C)) is off by C and costs a negligible share
    for C, M, W, R in [(90, 10800, 0, 0), (4, 10800, 30, 600), (20, 1800, 5, 60)]:
        young = math.sqrt(2 * C * M)
        opt = young - C

        def waste(tau, C=C, W=W, R=R, M=M):
            return gp.waste_first_order(gp.Timeline(tau, C, W, R), M)["total"]

        for f in (0.8, 0.95, 1.05, 1.25):
            assert waste(opt * f) > waste(opt)
        assert 0 <= waste(young) - waste(opt) < 0.002
        # the exact model's best interval is also close to Young's, and gains little over it
        best = gp.best_interval(gp.Timeline(young, C, W, R), M)
        assert abs(best - young) < 0.15 * young
        g_young = gp.goodput(gp.Timeline(young, C, W, R), M)
        assert 0 <= gp.goodput(gp.Timeline(best, C, W, R), M) - g_young < 0.002


def test_goodput_monotone_and_bounded():
    base = dict(tau=600, C=30, W=60, R=120)
    g0 = gp.goodput(gp.Timeline(**base), 7200)
    assert 0 < g0 < 600 / 630
    for k in ("C", "W", "R"):
        assert gp.goodput(gp.Timeline(**(base | {k: base[k] * 2})), 7200) < g0
    assert gp.goodput(gp.Timeline(**base), 14400) > g0
    # far from the first-order regime the exact value stays a share of time; first order goes negative
    t = gp.Timeline(tau=3000, C=300, W=300, R=600)
    assert 0 < gp.goodput(t, 1000) < 0.2 and gp.waste_first_order(t, 1000)["total"] > 1


@pytest.mark.parametrize("tau,C,W,R,mtbf", [
    (1394.27, 90, 0, 0, 10800),   # the textbook's synchronous case
    (300, 30, 200, 120, 3000),    # an asynchronous write and a restart
    (10, 0.5, 35, 5, 200),        # several checkpoints in flight (W > tau), as the appliance pipelines
    (50, 0, 50, 20, 60),          # MTBF near the interval: far outside first order
])
def test_exact_goodput_matches_simulation(tau, C, W, R, mtbf):
    t = gp.Timeline(tau, C, W, R)
    rng = np.random.default_rng(11)
    work = max(1500 * mtbf, 20000 * tau)  # spread over seeds: under 0.7% (1 sigma), bias under 0.2%
    got = work / gp.simulate(t, mtbf, work, rng)
    assert got == pytest.approx(gp.goodput(t, mtbf), rel=0.025)


def test_simulation_without_failures_is_the_schedule():
    t = gp.Timeline(tau=10, C=2, W=3, R=5)
    assert gp.simulate(t, 1e12, 95, np.random.default_rng(0)) == pytest.approx(95 + 9 * 2)


class _Draws:
    """An rng whose exponential draws are given."""

    def __init__(self, *xs):
        self.xs = list(xs)

    def exponential(self, mean):
        return self.xs.pop(0)


def test_simulation_takes_measured_restarts_in_order():
    t = gp.Timeline(tau=10, C=0, W=0, R=1)
    # a failure at 5 s (back to 0), then none: restart, then 20 s of work
    assert gp.simulate(t, 1.0, 20, _Draws(5.0, 1e6)) == pytest.approx(5 + 1 + 20)
    assert gp.simulate(t, 1.0, 20, _Draws(5.0, 1e6), restarts=(3.0,)) == pytest.approx(5 + 3 + 20)
    # the second failure comes 2 s into the first restart: the first measured restart is the one that completes
    assert gp.simulate(t, 1.0, 20, _Draws(5.0, 2.0, 1e6), restarts=(3.0, 9.0)) == pytest.approx(5 + 2 + 3 + 20)


def test_gockpt_stall_and_best_k():
    S, G, B, T = 98e9, 14e9, 10e9, 2.0  # 9.8 s of copying, 2 s steps
    for k in range(1, 20):
        want = sum(i / k * G / B for i in range(1, k)) + max(0.0, S / B - k * T)
        assert gp.gockpt_stall(S, G, B, T, k) == pytest.approx(want)
    k = gp.best_gockpt_steps(S, G, B, T)
    assert all(gp.gockpt_stall(S, G, B, T, k) <= gp.gockpt_stall(S, G, B, T, j) for j in range(1, 65))
    assert gp.gockpt_stall(1e9, 1e8, 10e9, 1.0, 1) == 0  # a copy that fits in one step is hidden


# -- strategies ---------------------------------------------------------------------------------

FULL = ("--params", "7B", "--mtbf-hours", 3, "--step-seconds", 10, "--write-gbps", 10, "--snapshot-gbps", 50,
        "--read-gbps", 20, "--restore-gbps", 10, "--restart-seconds", 300, "--ranks", 8, "--mirrors", 3)


def test_every_strategy_with_the_numbers_it_used():
    r = plan_json(*FULL)
    st = r["strategies"]
    S = 7e9 * 14
    assert all(s["available"] for s in st.values())
    assert st["synchronous"]["stall_s"] == pytest.approx(S / 10e9 + S / 50e9)
    assert st["asynchronous"]["stall_s"] == pytest.approx(S / 50e9)
    assert st["asynchronous"]["restorable_lag_s"] == pytest.approx(S / 10e9)
    assert st["asynchronous"]["interval_s"] >= st["asynchronous"]["restorable_lag_s"]
    assert st["synchronous"]["load_s"] == pytest.approx(S / 20e9)
    m = st["mirror"]
    assert m["interval_s"] == 10 and m["load_s"] == pytest.approx(S / 10e9)
    # the mirror loses half a step plus its lag (a step) per failure, less than any other
    assert m["lost_work_per_failure_s"] == pytest.approx(1.5 * 10, rel=1e-3)
    assert min(s["lost_work_per_failure_s"] for k, s in st.items() if k != "mirror") > 1.5 * 10
    assert m["goodput"] > st["asynchronous"]["goodput"] > st["synchronous"]["goodput"]
    for s in st.values():
        assert s["used"]["mtbf_s"] == {"value": 10800.0, "source": "given"}
    assert st["asynchronous"]["used"]["snapshot_GBps"] == {"value": 50.0, "source": "given"}


def test_mirror_fallback_from_eq2_and_recommended_mirrors():
    # FlowCheck 6.2: p = 1e-9, DP group 8, 16 M packets: two mirrors ~4e-3, three ~6e-12
    args = ("--mtbf-hours", 3, "--step-seconds", 1, "--gockpt-stall-seconds", 5, "--gockpt-steps", 7,
            "--packets", 16e6, "--ranks", 8, "--mirror-loss", 1e-9)
    two = plan_json(*args, "--mirrors", 2, "--target", 1e-3)["strategies"]["mirror"]
    three = plan_json(*args, "--mirrors", 3, "--target", 1e-3)["strategies"]["mirror"]
    assert two["fallback"]["probability_per_iteration"] == pytest.approx(lossmodel.eq2(1e-9, 2, 8, 16e6))
    assert 3e-3 < two["fallback"]["probability_per_iteration"] < 4e-3
    assert two["fallback"]["recommended_mirrors"] == three["fallback"]["recommended_mirrors"] == 3
    # fallbacks cost GoCkpt stalls: two mirrors lose goodput three do not
    q = two["fallback"]["probability_per_iteration"]
    assert two["stall_s"] == pytest.approx(5 * q / (1 + 7 * q))
    assert three["stall_s"] == pytest.approx(0, abs=1e-9)
    assert two["goodput"] < three["goodput"]
    assert plan_json(*args, "--mirrors", 2, "--target", 0)["strategies"]["mirror"]["fallback"][
        "recommended_mirrors"] is None


def test_sweep_over_model_size_scales_given_costs():
    inp = planner.Inputs(mtbf_s=3600, params=1e9, sync_stall_s=10, source={})
    a = planner.plan(inp)["strategies"]["synchronous"]
    b = planner.plan(planner.Inputs(mtbf_s=3600, params=4e9, sync_stall_s=40, source={}))["strategies"]["synchronous"]
    assert planner.sweep(inp, "params", [4e9])["synchronous"] == [b["goodput"]]
    assert planner.sweep(inp, "mtbf_s", [3600])["synchronous"] == [a["goodput"]]
    assert planner.sweep(inp, "params", [4e9])["mirror"] == [None]  # no step time


def test_plots(tmp_path):
    import matplotlib.image  # the `plot` extra; installed by `make test`

    r = plan_json(*FULL, "--plot", tmp_path)
    assert sorted(Path(p).name for p in r["plots"]) == ["goodput_vs_model_size.png", "goodput_vs_mtbf.png"]
    for p in r["plots"]:
        img = matplotlib.image.imread(p)
        assert img.shape[0] > 300 and img.shape[1] > 500
        assert img[..., :3].std() > 0.05  # not blank
    only = plan_json("--checkpoint-seconds", 90, "--mtbf-hours", 3, "--plot", tmp_path / "b")["plots"]
    assert [Path(p).name for p in only] == ["goodput_vs_mtbf.png"]  # no size: no model-size plot


# -- progress ------------------------------------------------------------------------------------


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_on_a_terminal_only():
    t = Tty()
    with Progress("replay", total=4, unit="files", stream=t, min_interval=0) as bar:
        bar.update(1, note="a.pcap")
        bar.echo("a log line")
        bar.update(3)
    out = t.getvalue()
    assert "\rreplay  1/4 files" in out and "a.pcap" in out and "a log line\n" in out
    assert "4/4 files" in out and out.endswith("\n")
    quiet = io.StringIO()
    with Progress("replay", total=4, stream=quiet, tick=0.01) as bar:
        bar.update(2)
        bar.echo("kept")
    assert quiet.getvalue() == "kept\n"


def test_progress_ticks_while_a_step_runs():
    import time

    t = Tty()
    with Progress("bench", total=2, stream=t, tick=0.01):
        time.sleep(0.1)
    assert t.getvalue().count("\r") >= 3
