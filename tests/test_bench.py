import csv

import pytest
import yaml

from decode.bench import expand, run

TINY_BENCH = {
    "max_new_tokens": 10, "prompt_sets": [{"name": "pycode", "split": "dev", "limit": 3}],
    "methods": [
        {"name": "target", "kind": "target"}, {"name": "draft", "kind": "draft"},
        {"name": "HF K={v}", "kind": "hf", "grid": {"hf.k": [2]}},
        {"name": "HF confidence", "kind": "hf", "hf": {"confidence": 0.4}},
        {"name": "SD K={v}", "family": "fixed", "policy": {"class_path": "decode.policies.FixedK"},
         "rule": {"class_path": "decode.rules.SpeculativeSampling"}, "grid": {"policy.k": [1, 3]}},
        {"name": "FSD JS T={v}", "family": "fsd", "policy": {"class_path": "decode.policies.FixedK", "init_args": {"k": 3}},
         "rule": {"class_path": "decode.rules.FSD", "init_args": {"divergence": "js"}}, "grid": {"rule.threshold": [0.1, 0.3]}},
    ],
}


def test_grid_expansion():
    ms = expand(dict(TINY_BENCH["methods"][4]))
    assert [m.name for m in ms] == ["SD K=1", "SD K=3"] and ms[1].policy["init_args"] == {"k": 3}


@pytest.mark.slow
def test_bench_prints_table_and_writes_csv_and_plots(tmp_path, capsys):
    from tests.tiny import write_tiny_pair

    # Hugging Face assisted generation needs equal embedding sizes: no padded rows here
    pair_yaml = write_tiny_pair(tmp_path / "pair", pad_rows=0)
    cfg = TINY_BENCH | {"pair": str(pair_yaml), "output": str(tmp_path / "out")}
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = run(str(path))
    names = [r["method"] for r in rows]
    assert names[:7] == ["target", "draft", "HF K=2", "HF confidence", "SD K=1", "SD K=3", "FSD JS T=0.1"]
    assert any(n.startswith("random allocation") for n in names)
    target = rows[0]
    assert target["speedup"] == 1.0 and target["verification_rate"] == 1.0
    sd1 = rows[4]
    assert sd1["discard_rate"] >= 0 and sd1["mean_accepted"] <= 1
    out = capsys.readouterr().out
    assert "| SD K=3 |" in out and "t_target" in out
    with open(tmp_path / "out" / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    for png in ("pareto_pycode_dev.png", "speed_quality_pycode_dev.png"):
        assert (tmp_path / "out" / png).stat().st_size > 5000


def test_write_readme_replaces_only_the_generated_block(tmp_path):
    from decode.bench import README_END, README_START, write_readme

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_START}\nold\n{README_END}\noutro\n")
    write_readme("| new | table |", readme)
    assert readme.read_text() == f"intro\n{README_START}\n| new | table |\n{README_END}\noutro\n"
    readme.write_text("no block")
    with pytest.raises(ValueError, match="no <!-- bench:start -->"):
        write_readme("x", readme)
