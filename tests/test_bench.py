import csv
import subprocess

import pytest
import torch
import yaml

from decode.evaluation.bench import expand, run
from decode.evaluation.report import made_by, provenance

TINY_BENCH = {
    "max_new_tokens": 10, "prompt_sets": [{"name": "pycode", "dev": {"split": "dev", "limit": 3},
                                           "test": {"split": "test", "limit": 4}}],
    "goals": [{"kind": "beats", "name": "SD beats FSD", "a": "fixed", "b": "fsd"},
              {"kind": "each", "name": "SD vs HF", "a": "SD K={v}", "b": "HF K={v}", "values": [2]},
              {"kind": "beats", "name": "FSD beats the K chosen on dev", "a": "fsd", "b": "fixed@dev"}],
    "sections": [{"sampling": {"temperature": 1.0}, "methods": [
        {"name": "target", "kind": "target"}, {"name": "draft", "kind": "draft"},
        {"name": "HF K={v}", "kind": "hf", "grid": {"hf.k": [2]}},
        {"name": "HF confidence", "kind": "hf", "hf": {"confidence": 0.4}},
        {"name": "SD K={v}", "family": "fixed", "select": "mark", "policy": {"class_path": "decode.policies.FixedK"},
         "rule": {"class_path": "decode.rules.SpeculativeSampling"}, "grid": {"policy.k": [1, 2]}},
        {"name": "FSD JS T={v}", "family": "fsd", "select": "dev",
         "policy": {"class_path": "decode.policies.FixedK", "init_args": {"k": 3}},
         "rule": {"class_path": "decode.rules.FSD", "init_args": {"divergence": "js"}}, "grid": {"rule.threshold": [0.1, 0.3]}},
    ]}],
}


def test_prompt_sets_option_keeps_the_named_sets_and_names_the_ones_there_are(tmp_path):
    from decode.evaluation.bench import BadBenchConfig, load_config

    path = tmp_path / "bench.yaml"
    two = TINY_BENCH["prompt_sets"] + [TINY_BENCH["prompt_sets"][0] | {"name": "humaneval"}]
    path.write_text(yaml.safe_dump(TINY_BENCH | {"prompt_sets": two}))
    assert [ps["name"] for ps in load_config(str(path), False, None)["prompt_sets"]] == ["pycode", "humaneval"]
    assert [ps["name"] for ps in load_config(str(path), False, None, None, ["humaneval"])["prompt_sets"]] == ["humaneval"]
    with pytest.raises(BadBenchConfig, match="--prompt_sets mbpp: bench.yaml has pycode, humaneval"):
        load_config(str(path), False, None, None, ["mbpp"])


def test_settings_option_keeps_the_sections_of_the_named_settings_and_names_the_ones_there_are():
    """The greedy section of the shipped bench alone (what python -m decode bench --settings greedy runs)."""
    from decode.evaluation.bench import BadBenchConfig, load_config

    cfg = load_config("configs/bench/pycode.yaml", False, None, settings=["greedy"])
    assert [sec["sampling"] for sec in cfg["sections"]] == [{"temperature": 0.0}]
    both = load_config("configs/bench/pycode.yaml", False, None, settings=["t1", "greedy"])["sections"]
    assert [sec["sampling"]["temperature"] for sec in both] == [0.0, 1.0]  # the YAML's order
    with pytest.raises(BadBenchConfig, match="--settings t2: pycode.yaml has greedy, t0.7-p0.95, t1"):
        load_config("configs/bench/pycode.yaml", False, None, settings=["t2"])


def test_quick_runs_write_to_an_ignored_scratch_folder_never_the_committed_results():
    import subprocess

    from decode.evaluation.bench import ROOT, load_config, run

    cfg = load_config("configs/bench/pycode.yaml", True, None)
    assert cfg["output"] == "runs/bench-quick/bench"
    ignored = subprocess.run(["git", "check-ignore", "-q", cfg["output"] + "/bench.csv"], cwd=ROOT)
    assert ignored.returncode == 0  # git status stays clean after a smoke run
    assert load_config("configs/bench/pycode.yaml", False, None)["output"] == "docs/bench"
    with pytest.raises(ValueError, match="smoke run"):
        run("configs/bench/pycode.yaml", quick=True, readme=True)


def test_grid_expansion():
    ms = expand(dict(TINY_BENCH["sections"][0]["methods"][4]))
    assert [m.name for m in ms] == ["SD K=1", "SD K=2"] and ms[1].policy["init_args"] == {"k": 2}
    raw = {"name": "h", "policy": {"class_path": "decode.policies.SpecDecPP", "init_args": {"head_dir": "ck/s{suffix}"}},
           "rule": {"class_path": "decode.rules.SpeculativeSampling"}}
    assert expand(raw, "-greedy")[0].policy["init_args"]["head_dir"] == "ck/s-greedy"


@pytest.mark.slow
def test_bench_prints_table_and_writes_csv_and_plots(tmp_path, capsys):
    from tests.tiny import write_tiny_pair

    # Hugging Face assisted generation needs equal embedding sizes: no padded rows here
    pair_yaml = write_tiny_pair(tmp_path / "pair", pad_rows=0)
    # At the suite's thread count (tests/conftest.py), not the bench's default of 2, which would oversubscribe the cores;
    # 2 timings a cell for the cost model, not 7: the test reads that the model is measured and used, not its precision
    cfg = TINY_BENCH | {"pair": str(pair_yaml), "output": str(tmp_path / "out"), "threads": torch.get_num_threads(),
                        "cost_repeats": 2}
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = run(str(path))
    names = [r["method"] for r in rows]
    # the FSD grid was swept on dev and one threshold kept for test; every other method runs on test
    assert names[:6] == ["target", "draft", "HF K=2", "HF confidence", "SD K=1", "SD K=2"]
    assert sum(n.startswith("FSD JS") for n in names) == 1
    assert any(n.startswith("random allocation") for n in names)
    target = rows[0]
    assert target["speedup"] == 1.0 and target["speedup_lo"] == target["speedup_hi"] == 1.0
    # a ratio of timings: present and positive; its value is the bench's to report, not a test's to assert
    assert target["engine_efficiency"] > 0 and target["cost_model_tokens_per_s"] > 0
    for r in rows[1:6]:
        assert r["speedup_lo"] <= r["speedup"] <= r["speedup_hi"]
    assert rows[4]["discard_rate"] >= 0 and rows[4]["mean_accepted"] <= 1
    # both Ks ran on test, and replay on dev marked one of them
    assert [r["dev_choice"] for r in rows[4:6]] in ([True, False], [False, True]) and not rows[0]["dev_choice"]
    out = capsys.readouterr().out
    assert "| SD K=2 |" in out and "measured/predicted" in out and "**SD vs HF**" in out
    assert "**FSD beats the K chosen on dev**" in out and "fixed, replayed speedup on 3 dev prompts" in out
    with open(tmp_path / "out" / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) > len(rows)  # test rows and the dev sweep
    assert "FSD JS T=0.1" in (tmp_path / "out" / "dev.md").read_text()
    # each row carries what made it, and the tables' first line names it (the commit and the machine)
    made = provenance()
    assert all(r["commit"] == made["commit"] and r["machine"] == made["machine"] for r in rows)
    assert f"{made_by(rows)}." in (tmp_path / "out" / "bench.md").read_text() and made["machine"] in made_by(rows)
    for png in ("pareto_pycode_t1.png", "speed_quality_pycode_t1.png"):
        assert (tmp_path / "out" / png).stat().st_size > 5000
    again = run(str(path))  # every section resumes from its saved rows
    assert [r["speedup"] for r in again] == [r["speedup"] for r in rows]


def test_a_saved_split_is_keyed_by_the_code_and_the_heads_that_made_it(tmp_path, monkeypatch):
    import decode.evaluation.bench as bench

    for f, text in (("decode/engine.py", "v1"), ("heads/head.py", "h1"), ("ck/h/config.json", "{}"),
                    ("ck/h/model.safetensors", "w1"), ("decode/policies/__init__.py", "p1"),
                    ("decode/evaluation/compare.py", "c1")):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(text)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    with_head = [bench.Method("target", kind="target"),
                 bench.Method("h", policy={"class_path": "x.P", "init_args": {"head_dir": "ck/h"}})]
    first = bench.fingerprint(with_head)
    assert bench.fingerprint(with_head) == first  # nothing changed: the split resumes
    (tmp_path / "ck/h/model.safetensors").write_text("w2")  # a retrained head
    retrained = bench.fingerprint(with_head)
    assert retrained != first and bench.fingerprint(with_head[:1]) == bench.fingerprint(with_head[:1])
    without = bench.fingerprint(with_head[:1])
    (tmp_path / "decode/evaluation/compare.py").write_text("c2")  # reads saved rows, makes none: the split resumes
    assert bench.fingerprint(with_head) == retrained and bench.fingerprint(with_head[:1]) == without
    (tmp_path / "decode/policies/__init__.py").write_text("p2")  # names the class a config's class_path loads
    assert bench.fingerprint(with_head) != retrained and bench.fingerprint(with_head[:1]) != without
    retrained, without = bench.fingerprint(with_head), bench.fingerprint(with_head[:1])
    (tmp_path / "decode/engine.py").write_text("v2")  # an engine change
    assert bench.fingerprint(with_head) != retrained and bench.fingerprint(with_head[:1]) != without


def test_provenance_names_the_last_commit_that_changed_what_decides_a_result(tmp_path, monkeypatch):
    import decode.evaluation.report as report

    monkeypatch.setattr(report, "ROOT", tmp_path)
    assert provenance()["commit"] == "unknown"  # not a git checkout: said, never raised

    def commit(*files: str) -> str:
        for f in files:
            (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / f).write_text(f"{f} {len(list(tmp_path.rglob('*')))}")
        git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "add", "-A"], check=True, capture_output=True)
        subprocess.run([*git, "commit", "-qm", "x"], check=True, capture_output=True)
        return subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    engine = commit("decode/engine.py", "docs/a.md")
    assert provenance()["commit"] == engine
    commit("docs/a.md", "decode/evaluation/report.py", "README.md")  # docs and presentation: the rows are the same
    assert provenance()["commit"] == engine
    assert commit("checkpoints/h/config.json") == provenance()["commit"] != engine  # a retrained head
    (tmp_path / "heads/head.py").parent.mkdir()
    (tmp_path / "heads/head.py").write_text("uncommitted")
    assert provenance()["commit"].endswith("+changes")


def test_provenance_names_the_machine_and_a_run_made_on_two_names_both():
    made = provenance()
    cpu = f"({torch.backends.cpu.get_cpu_capability()}, {{}}, {torch.get_num_threads()} threads)"
    assert cpu.format("AMX") in made["machine"] or cpu.format("no AMX") in made["machine"]
    other = {"commit": "abcdef0+changes", "machine": "another CPU"}
    assert made_by([made, made, other]).endswith("; at abcdef0 with uncommitted changes on another CPU")
    assert made_by([made]).count(" on ") == 1  # one clause per distinct pair
    assert made_by([{}]) == "decoded at an unrecorded commit on an unrecorded machine"  # a CSV from before provenance


def test_bootstrap_interval_and_call_log_cost_model():
    import numpy as np

    from decode.costs.model import CostModel
    from decode.evaluation.intervals import bootstrap_ci

    same = np.full((30, 2), 1.5)
    assert bootstrap_ci(same) == (1.5, 1.5)
    rng = np.random.default_rng(0)
    noisy = 1.2 + 0.1 * rng.standard_normal((400, 1))
    lo, hi = bootstrap_ci(noisy)
    assert lo < noisy.mean() < hi and abs((hi - lo) - 2 * 1.96 * 0.1 / 20) < 0.004  # the normal-theory width
    cm = CostModel(step={"draft": [1.0, 1.5], "target": [6.0, 6.5, 7.0]},
                   prefill={"draft": ([10, 30], [2.0, 4.0]), "target": ([10, 30], [10.0, 30.0])})
    calls = [("draft", 20), ("target", 20), ("draft", 1), ("draft", 2), ("target", 3)]
    assert abs(cm.predict_s(calls) - 1e-3 * (3.0 + 20.0 + 1.0 + 1.5 + 7.0)) < 1e-12
    # The log is ordered: a forward right after the other model's is priced from the switched table
    # (the draft's first step of a round after the target's check), prefill stays on the prefill curve.
    cm.switched = {"draft": [1.25, 1.75], "target": [6.5, 7.0, 7.5]}
    assert abs(cm.predict_s(calls) - 1e-3 * (3.0 + 20.0 + 1.25 + 1.5 + 7.5)) < 1e-12
    assert abs(cm.predict_s([("target", 1)] * 3) - 3 * 6.0e-3) < 1e-12  # the target alone never switches


def test_goal_lines_read_the_intervals():
    from decode.evaluation.goals import goal_lines

    rows = [{"method": "a1", "family": "A", "speedup": 1.5, "speedup_lo": 1.4, "speedup_hi": 1.6},
            {"method": "b1", "family": "B", "speedup": 1.2, "speedup_lo": 1.1, "speedup_hi": 1.3},
            {"method": "c1", "family": "C", "speedup": 1.45, "speedup_lo": 1.2, "speedup_hi": 1.7}]
    lines = goal_lines(rows, [{"kind": "beats", "name": "A beats B", "a": "A", "b": "B"},
                              {"kind": "beats", "name": "B beats A", "a": "B", "b": "A"},
                              {"kind": "beats", "name": "C beats B", "a": "C", "b": "B"},
                              {"kind": "beats", "name": "absent", "a": "Z", "b": "B"}])
    assert [ln.split(" — ")[1].split(":")[0] for ln in lines] == ["met", "NOT met", "not separated (intervals overlap)"]


def test_write_readme_replaces_only_the_generated_block(tmp_path):
    from decode.evaluation.report import README_END, README_START, write_readme

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_START}\nold\n{README_END}\noutro\n")
    write_readme("| new | table |", readme)
    assert readme.read_text() == f"intro\n{README_START}\n| new | table |\n{README_END}\noutro\n"
    readme.write_text("no block")
    with pytest.raises(ValueError, match="no <!-- bench:start -->"):
        write_readme("x", readme)


def test_the_readme_line_links_the_run_folder_from_the_project_root(tmp_path, monkeypatch):
    from decode.evaluation import bench

    said = []
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "write_readme", said.append)
    out = tmp_path / "docs" / "bench"
    out.mkdir(parents=True)
    rows = [{"prompts": "pycode/test greedy", "method": "target", "family": "target", "kind": "target",
             "tokens_per_s": 100.0, "speedup": 1.0, "speedup_lo": 1.0, "speedup_hi": 1.0}]
    bench.write_outputs(out, rows, ["x"], [], "--config c.yaml", readme=True)
    assert "every row of every split in `docs/bench/bench.md`" in said[0] and "| pycode | greedy | 100 |" in said[0]


def test_compare_two_runs(tmp_path, capsys):
    from decode.evaluation.compare import main

    head = "prompts,method,speedup,speedup_lo,speedup_hi\n"
    (tmp_path / "a.csv").write_text(head + "p/test greedy,SD K=2,1.5,1.4,1.6\np/test greedy,SD K=4,1.8,1.7,1.9\n"
                                    "p/test greedy,SpecDec++ h=0.5,1.9,1.8,2.0\n")
    (tmp_path / "b.csv").write_text(head + "p/test greedy,SD K=2,1.55,1.45,1.65\np/test greedy,SD K=4,2.1,1.95,2.2\n"
                                    "p/test greedy,SpecDec++ h=0.7,1.9,1.8,2.0\n")
    main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    out = capsys.readouterr().out
    assert "| p/test greedy | SD K=2 |" in out and "| yes |" in out and "| **no** |" in out
    assert out.count("one run only") == 2 and "1 of 2 shared rows" in out and "NOT met" in out
    dev = "p/dev greedy,SD K=2,1.0,0.9,1.1\n"
    (tmp_path / "a.csv").write_text((tmp_path / "a.csv").read_text() + dev)
    (tmp_path / "b.csv").write_text((tmp_path / "b.csv").read_text() + dev)
    main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert "2 of 3 shared rows" in capsys.readouterr().out
    main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--split", "test", "--plots", str(tmp_path / "png")])
    assert "1 of 2 shared rows" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "png").iterdir()] == ["compare_p_test_greedy.png"]  # the dev split is left out
    assert (tmp_path / "png" / "compare_p_test_greedy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no such file"):
        main([str(tmp_path / "a.csv"), str(tmp_path / "missing.csv")])


def test_compare_warns_when_the_runs_model_steps_differ(tmp_path, capsys):
    """Per split, ms per token of the target alone and the draft alone: a 30% faster target in one split is flagged."""
    from decode.evaluation.compare import main

    head = "prompts,method,kind,speedup,speedup_lo,speedup_hi,target_calls,draft_calls,t_target_s,t_draft_s\n"

    def run(target_s):
        return head + "".join(f"{p},target,target,1,1,1,100,0,{t},0\n{p},draft,draft,5,4,6,0,100,0,0.25\n"
                              for p, t in (("p/test greedy", 1.3), ("p/test t1", target_s)))

    (tmp_path / "a.csv").write_text(run(1.3))
    (tmp_path / "b.csv").write_text(run(0.9))
    main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    out = capsys.readouterr().out
    assert "| p/test greedy | 13.00 | 13.00 | 2.50 | 2.50 |" in out and "| p/test t1 | 13.00 | 9.00 |" in out
    assert "warning: in 1 of 2 splits" in out and "(p/test t1)" in out
    (tmp_path / "b.csv").write_text(run(1.2))  # 8% apart: within the drift of one machine
    main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert "warning" not in capsys.readouterr().out


def test_each_section_names_its_heads_with_their_dev_auroc(tmp_path):
    import json

    from decode.evaluation.bench import Method, head_lines

    head = tmp_path / "specdecpp-greedy"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({
        "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, "label": {"family": "SoftAcceptance"},
        "metrics": {"auroc": 0.8056, "draft_confidence_auroc": 0.7712, "positions": 6277}}))
    policy = {"class_path": "decode.policies.SpecDecPP", "init_args": {"head_dir": str(head)}}
    lines = head_lines([Method("SD K=2", policy={"class_path": "decode.policies.FixedK"}),
                        Method("SpecDec++ h=0.5", policy=policy), Method("HF + head", kind="hf", hf={"head": str(head)})])
    assert lines == [f"- head `{head}` (trained for greedy, SoftAcceptance): dev AUROC 0.806, draft confidence 0.771 "
                     "for the same event (6277 positions)"]


def test_paired_goals_tell_a_five_percent_difference_the_row_intervals_cannot():
    import numpy as np

    from decode.evaluation.goals import goal_lines
    from decode.evaluation.intervals import bootstrap_ci

    rng = np.random.default_rng(0)
    prompt = rng.uniform(0.7, 1.5, size=(40, 1))  # prompts differ far more than the methods do
    a = prompt * 1.05 * (1 + 0.01 * rng.standard_normal((40, 1)))
    b = prompt * (1 + 0.01 * rng.standard_normal((40, 1)))
    rows = [{"method": m, "family": m, "speedup": float(r.mean()), "ratios": r.tolist(),
             **dict(zip(("speedup_lo", "speedup_hi"), bootstrap_ci(r)))} for m, r in (("A", a), ("B", b))]
    assert rows[0]["speedup_lo"] < rows[1]["speedup_hi"]  # the rows' own intervals overlap
    met, lost = goal_lines(rows, [{"kind": "beats", "name": "A beats B", "a": "A", "b": "B"},
                                  {"kind": "beats", "name": "B beats A", "a": "B", "b": "A"}])
    assert "— met (paired a/b 1.05" in met and "— NOT met (paired a/b 0.95" in lost
    same = [r | {"method": r["method"] + "'", "family": "S" + r["family"], "ratios": b.tolist()} for r in rows]
    assert "not separated (paired" in goal_lines(same, [{"kind": "beats", "name": "x", "a": "SA", "b": "SB"}])[0]


def test_cost_model_mean_of_measurements_through_a_section():
    from decode.costs.model import CostModel

    a = CostModel(step={"draft": [1.0], "target": [6.0, 7.0]}, prefill={"target": ([10, 30], [10.0, 30.0])},
                  switched={"draft": [1.2], "target": [6.0, 7.4]})
    b = CostModel(step={"draft": [2.0], "target": [8.0, 9.0]}, prefill={"target": ([10, 30], [12.0, 34.0])},
                  switched={"draft": [2.2], "target": [8.0, 9.6]})
    m = CostModel.mean([a, b])
    assert m.step == {"draft": [1.5], "target": [7.0, 8.0]} and m.prefill["target"] == ([10, 30], [11.0, 32.0])
    assert m.switched["target"] == [7.0, 8.5] and abs(m.switched["draft"][0] - 1.7) < 1e-12
    assert abs(m.predict_s([("draft", 1), ("target", 2), ("target", 20)]) - 1e-3 * (1.5 + 8.5 + 21.5)) < 1e-12


def test_paired_goals_are_symmetric_when_a_few_prompts_have_large_ratios():
    from decode.evaluation.goals import paired

    a = [[1.0]] * 8 + [[4.0]] * 2  # a wins big on two prompts
    b = [[2.0]] * 8 + [[1.0]] * 2  # b wins by 2x on eight
    ab, ba = paired({"ratios": a}, {"ratios": b}), paired({"ratios": b}, {"ratios": a})
    assert abs(ab[0] * ba[0] - 1) < 1e-12 and ab[0] < 1 < ba[0]  # one of them wins, not both
    assert abs(ab[1] * ba[2] - 1) < 1e-9 and abs(ab[2] * ba[1] - 1) < 1e-9


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_cost_model_times_each_step_with_the_sections_sampling_work(tiny_pair, sampling):
    """Every cell of the step tables is filled on the tiny pair, greedy and under top-p (the transform of the
    target's n rows and the draw run inside each timed step)."""
    from decode.costs.model import CostModel

    pair = tiny_pair.with_sampling(**sampling)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 14)]
    cm = CostModel.measure(pair, prompts, n_max=6, repeats=1, growth=8)
    assert [len(cm.step[m]) for m in ("draft", "target")] == [4, 6] == [len(cm.switched[m]) for m in ("draft", "target")]
    assert all(ms > 0 for m in cm.step for ms in cm.step[m] + cm.switched[m])
    assert cm.prefill["target"][0] == [5, 9, 14] and cm.predict_s([("target", 1)] * 2) == pytest.approx(2e-3 * cm.step["target"][0])
    assert "target step" in cm.describe()


def test_summary_table_takes_the_best_fixed_k_and_drops_families_the_run_lacks():
    from decode.evaluation.summary import summary

    def row(method, family, s, prompts="pycode/test greedy", tps="100"):
        return {"prompts": prompts, "method": method, "family": family, "kind": "spec", "tokens_per_s": tps,
                "speedup": str(s), "speedup_lo": str(s - 0.1), "speedup_hi": str(s + 0.1)}

    rows = [row("target", "target", 1.0), row("SD K=2", "fixed-K", 1.2), row("SD K=3", "fixed-K", 1.3),
            row("oracle", "oracle", 1.5), row("SD K=3", "fixed-K", 9.0, prompts="pycode/dev greedy")]
    lines = summary(rows).splitlines()
    assert lines[0].count("|") == 8 and "best fixed K" in lines[0] and "SPRINTER" not in lines[0]
    assert "chosen on dev" not in lines[0]  # no row marked: an older run, or --quick
    assert len(lines) == 3 and "1.30 [1.20, 1.40] (K=3)" in lines[2] and "9.00" not in lines[2]
    rows[1]["dev_choice"] = "True"  # as bench.csv holds it: the dev choice is K = 2, slower on test
    lines = summary(rows).splitlines()
    assert "| best fixed K (hindsight) | fixed K chosen on dev |" in lines[0]
    assert "1.30 [1.20, 1.40] (K=3) | 1.20 [1.10, 1.30] (K=2)" in lines[2]


def test_summary_joins_runs_of_other_sections_and_reads_the_named_heads(tmp_path, capsys):
    """python -m decode summary over three runs' CSVs (one section each): one table with all, in an order that does not
    depend on the process, and the AUROC columns read from the --head and --prev_head folders of each setting."""
    import json

    from decode.evaluation.summary import main

    fields = ["prompts", "method", "family", "kind", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi"]
    paths = []
    for prompts, setting in (("instruct", "greedy"), ("humaneval", "greedy"), ("instruct", "t1")):
        path = tmp_path / f"{prompts}-{setting}" / "bench.csv"
        path.parent.mkdir()
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerow(dict(zip(fields, [f"{prompts}/test {setting}", "target", "target", "target", "20", "1", "1", "1"])))
            w.writerow(dict(zip(fields, [f"{prompts}/test {setting}", "SD K=3", "fixed-K", "spec", "30", "1.5", "1.4", "1.6"])))
        paths.append(str(path))
    for name, auroc in (("h-greedy", 0.81), ("h", 0.71), ("p-greedy", 0.91), ("p", 0.61)):
        (tmp_path / name).mkdir()
        sampling = {"temperature": 0.0 if name.endswith("-greedy") else 1.0}  # as the exporter writes it
        (tmp_path / name / "config.json").write_text(json.dumps(
            {"sampling": sampling, "metrics": {"auroc": auroc, "draft_confidence_auroc": 0.5}}))
    main(paths + ["--head", str(tmp_path / "h"), "--prev_head", str(tmp_path / "p")])
    lines = capsys.readouterr().out.splitlines()
    # one prompt set's rows together, the sets in the order the CSVs name them, each set's settings greedy first
    assert len(lines) == 5 and "| instruct | greedy |" in lines[2] and "| instruct | T = 1 |" in lines[3]
    assert "| humaneval | greedy |" in lines[4]
    assert lines[2].endswith("| 0.810 / 0.500 | 0.910 / 0.500 |") and lines[3].endswith("| 0.710 / 0.500 | 0.610 / 0.500 |")
    # a head's dev AUROC is one figure, not a reading on each prompt set: later sets point back to the first
    assert lines[4].endswith("| as for instruct | as for instruct |")


def test_summary_refuses_what_would_make_a_misleading_table(tmp_path, capsys):
    """A split in two runs (its ratios over two targets), a split without its target row, a head folder that is not
    there: each a one-line error naming the fix, where the table would have mixed runs, crashed or shown no figure."""
    from decode.evaluation.summary import main

    fields = ["prompts", "method", "family", "kind", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi"]

    def run_csv(name, rows):
        path = tmp_path / name / "bench.csv"
        path.parent.mkdir()
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            for row in rows:
                w.writerow(dict(zip(fields, row)))
        return str(path)

    target = ["instruct/test greedy", "target", "target", "target", "20", "1", "1", "1"]
    sd = ["instruct/test greedy", "SD K=3", "fixed-K", "spec", "30", "1.5", "1.4", "1.6"]
    heads = ["--head", "checkpoints/smollm2/specdecpp", "--prev_head", "checkpoints/smollm2/specdecpp-prev"]
    for argv, said in (([run_csv("a", [target, sd]), run_csv("b", [target, sd])] + heads, "is in both"),
                       ([run_csv("c", [sd])] + heads, "has no target row"),
                       ([run_csv("d", [target, sd]), "--head", "checkpoints/smollm2/typo"], "no head folder")):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert said in err, err
    # no figure on the first set's row: later sets say so too, rather than pointing back at nothing
    from decode.evaluation.summary import summary

    rows = [dict(zip(fields, [p + r[0][8:]] + r[1:])) for p in ("instruct", "humaneval") for r in (target, sd)]
    assert [line.endswith("| - | - |") for line in summary(rows, "nohead", "nohead").splitlines()[2:]] == [True] * 2


def test_goals_against_the_fixed_k_chosen_on_dev():
    from decode.evaluation.goals import goal_lines

    rows = [{"method": "SD K=2", "family": "fixed-K", "speedup": 1.2, "speedup_lo": 1.15, "speedup_hi": 1.25,
             "dev_choice": True},
            {"method": "SD K=3", "family": "fixed-K", "speedup": 1.5, "speedup_lo": 1.45, "speedup_hi": 1.55},
            {"method": "stop", "family": "cost-aware", "speedup": 1.35, "speedup_lo": 1.3, "speedup_hi": 1.4}]
    goals = [{"kind": "beats", "name": "vs dev K", "a": "cost-aware", "b": "fixed-K@dev"},
             {"kind": "beats", "name": "vs hindsight K", "a": "cost-aware", "b": "fixed-K"}]
    dev, hindsight = goal_lines(rows, goals)
    assert dev.startswith("- **vs dev K** — met") and "SD K=2" in dev
    assert hindsight.startswith("- **vs hindsight K** — NOT met") and "SD K=3" in hindsight
    rows[0]["dev_choice"] = False  # no row marked: the goal has no line, rather than a guess
    assert goal_lines(rows, goals[:1]) == []


def test_a_section_in_ignore_eos_decodes_every_method_through_its_eos(tmp_path):
    """Fixed lengths under sampling: with EOS set to the token each method draws first, every kind of method (target
    alone, our speculative decoder, Hugging Face's) stops after it, and with stop_at_eos False decodes all n."""
    import dataclasses

    from decode.evaluation.bench_config import Method
    from decode.evaluation.measuring import generator_for
    from decode.pair import load_pair
    from tests.tiny import write_tiny_pair

    tiny_pair = load_pair(write_tiny_pair(tmp_path, pad_rows=0))  # Hugging Face samples only with equal embeddings
    ids, n = [5, 6, 7, 8], 12
    sd = {"policy": {"class_path": "decode.policies.FixedK", "init_args": {"k": 3}},
          "rule": {"class_path": "decode.rules.SpeculativeSampling"}}
    for m in (Method("target", kind="target"), Method("SD", **sd), Method("HF", kind="hf", hf={"k": 2})):
        first = generator_for(tiny_pair, m)(ids, n, 3)[0][0]
        pair = dataclasses.replace(tiny_pair, eos_ids=(first,))
        assert generator_for(pair, m)(ids, n, 3)[0] == [first], m.name
        assert len(generator_for(pair, m, stop_at_eos=False)(ids, n, 3)[0]) == n, m.name


def test_ignore_eos_must_name_a_setting_of_the_config(tmp_path):
    from decode.evaluation.bench_config import load_config

    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(TINY_BENCH | {"ignore_eos": ["t1.0"]}))
    with pytest.raises(ValueError, match=r"ignore_eos names \['t1.0'\], which are not among its settings \['t1'\]"):
        load_config(str(path), False, None)
    path.write_text(yaml.safe_dump(TINY_BENCH | {"ignore_eos": "t1"}))
    with pytest.raises(ValueError, match=r"ignore_eos is 't1'; give a list of setting names, e.g. \[t1\]"):
        load_config(str(path), False, None)
    path.write_text(yaml.safe_dump(TINY_BENCH | {"ignore_eos": ["t1"]}))
    assert load_config(str(path), False, None)["ignore_eos"] == ["t1"]


def test_replay_on_dev_records_through_the_eos_where_the_section_decodes_fixed_lengths(tiny_pair):
    """A section in ignore_eos decodes test through its EOS, so the dev recordings that choose its grids must too."""
    import dataclasses

    from decode.evaluation.replay import record

    greedy = tiny_pair.with_sampling(temperature=0.0)
    first = record(greedy, [5, 6, 7, 8], 10).response[0]
    pair = dataclasses.replace(greedy, eos_ids=(first,))
    assert record(pair, [5, 6, 7, 8], 10).response == [first]
    assert len(record(pair, [5, 6, 7, 8], 10, stop_at_eos=False).response) == 10


def test_a_resumed_run_reuses_its_dev_choices_and_decodes_nothing_again(tmp_path, monkeypatch):
    """The grid's choice is made once, on recordings through the EOS where the section decodes fixed lengths: the
    second run reads it back, although replay would now choose otherwise (a freshly measured cost model can tip a
    near-tie), so the test split keeps its key and nothing decodes again."""
    import decode.evaluation.bench as bench
    from tests.tiny import write_tiny_pair

    cfg = {"pair": str(write_tiny_pair(tmp_path / "pair")), "output": str(tmp_path / "out"), "max_new_tokens": 6,
           "threads": torch.get_num_threads(), "cost_repeats": 2, "ignore_eos": ["t1"],
           "prompt_sets": [{"name": "pycode", "dev": {"split": "dev", "limit": 2}, "test": {"split": "test", "limit": 2}}],
           "sections": [{"sampling": {"temperature": 1.0}, "methods": [
               {"name": "target", "kind": "target"},
               {"name": "SD K={v}", "family": "fixed", "select": "mark", "policy": {"class_path": "decode.policies.FixedK"},
                "rule": {"class_path": "decode.rules.SpeculativeSampling"}, "grid": {"policy.k": [1, 2]}}]}]}
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    calls = []

    def flipping(pair, methods, prompts, cfg, stop_at_eos):  # replay whose pick changes from one call to the next
        calls.append(stop_at_eos)
        return methods, [f"call {len(calls)}"], {f"SD K={len(calls)}"}

    monkeypatch.setattr(bench, "choose_by_replay", flipping)
    first = bench.run(str(path))
    monkeypatch.setattr(bench, "interleaved", lambda *a, **k: pytest.fail("a finished split decoded again"))
    again = bench.run(str(path))
    assert calls == [False]  # chosen once, on recordings through the EOS
    assert [(r["method"], r["dev_choice"]) for r in again] == [(r["method"], r["dev_choice"]) for r in first]
    assert [r["method"] for r in first if r["dev_choice"]] == ["SD K=1"]
    pair, loaded = bench.load_pair(cfg["pair"]), bench.load_config(str(path), False, None)
    methods = [bench.Method("target", kind="target")]
    assert bench.work_key(pair, "p", [[1]], methods, loaded) != bench.work_key(pair, "p", [[1]], methods, loaded | {
        "ignore_eos": []}), "another length rule is other work"
    cfg["sections"][0]["methods"].append({"name": "target", "kind": "draft"})
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="names target more than once"):
        bench.run(str(path))


def test_head_folders_follow_the_pairs_own_setting_wherever_they_are_read(tiny_pair, tmp_path, monkeypatch):
    """Heads trained for the pair's own setting have no suffix, others '-<setting>', whatever the own setting is:
    the pair keeps it through with_sampling, and the summary reads the head whose config names the setting."""
    import dataclasses
    import json

    from decode.evaluation import summary
    from decode.pair import Sampling

    at_t1 = dataclasses.replace(tiny_pair, own=Sampling(temperature=1.0))
    assert at_t1.with_sampling(temperature=1.0).head_suffix() == ""
    assert at_t1.with_sampling(temperature=0.0).head_suffix() == "-greedy"
    at_greedy = dataclasses.replace(tiny_pair, own=Sampling(temperature=0.0))  # qwen2.5's and llama3.2's pairs
    assert at_greedy.with_sampling(temperature=0.0).head_suffix() == ""
    assert at_greedy.with_sampling(temperature=1.0).head_suffix() == "-t1"
    for folder, temperature, auroc in (("h", 0.0, 0.8), ("h-t1", 1.0, 0.6)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(
            {"sampling": {"temperature": temperature}, "metrics": {"auroc": auroc, "draft_confidence_auroc": 0.5}}))
    monkeypatch.setattr(summary, "ROOT", tmp_path)
    assert summary.head_auroc("greedy", "h") == "0.800 / 0.500"
    assert summary.head_auroc("t1", "h") == "0.600 / 0.500"
    assert summary.head_auroc("t0.7-p0.95", "h") == "-"  # none trained for it: no figure rather than another's
