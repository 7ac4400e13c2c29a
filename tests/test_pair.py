import json
from pathlib import Path

import pytest
import torch

from decode.pair import PairConfig, load_pair
from decode.vocab import VocabularyMismatch
from tests.tiny import ALPHABET, write_tiny_pair

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_pair_loads_and_cuts_padded_rows(tiny_pair):
    assert tiny_pair.vocab == len(ALPHABET) + 1
    rows = tiny_pair.target.get_output_embeddings().weight.shape[0]
    assert rows > tiny_pair.vocab  # the target has padded embedding rows
    logits = tiny_pair.target(torch.tensor([[1, 2, 3]])).logits
    assert tiny_pair.logits(logits).shape[-1] == tiny_pair.vocab


def test_vocabulary_size_mismatch_names_both_sizes(tmp_path):
    path = write_tiny_pair(tmp_path, draft_alphabet=ALPHABET[:-3])
    with pytest.raises(VocabularyMismatch, match=r"draft vocabulary has 21 tokens, target vocabulary has 24"):
        load_pair(path)


def test_same_size_different_tokens_is_refused(tmp_path):
    path = write_tiny_pair(tmp_path, draft_alphabet=list(reversed(ALPHABET)))
    with pytest.raises(VocabularyMismatch, match="tokenize"):
        load_pair(path)


def test_two_ids_swapped_outside_the_probe_text_are_refused(tmp_path):
    """Same size, same probe encoding ('a' and 'b' appear nowhere in it), but two tokens trade ids: p and q would be
    compared token for token across different tokens, so loading refuses the pair and names what moved."""
    swapped = list(ALPHABET)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    path = write_tiny_pair(tmp_path, draft_alphabet=swapped)
    with pytest.raises(VocabularyMismatch, match=r"2 ids stand for other bytes \(id \d+ is '\w' in the draft, '\w' in the target"):
        load_pair(path)


def test_an_entry_spelled_otherwise_that_holds_the_same_bytes_is_the_same_token():
    """Transformers respells a GGUF's entries in byte-level letters where the file holds their text (a DeepSeek
    control token, an added token written as text), and a byte can be spelled <0xNN>: the same bytes, the same token.
    A lone byte of a multi-byte character or a sentencepiece word start traded for a plain piece is another token,
    though each decodes alike on its own."""
    from decode.vocab import BYTE_OF, check_vocabularies

    letter = {b: c for c, b in BYTE_OF.items()}

    def level(text: str) -> str:  # byte-level BPE's spelling of text
        return "".join(letter[b] for b in text.encode("utf-8"))

    class Tok:
        def __init__(self, *entries: str):
            self.entries = entries

        def __len__(self):
            return len(self.entries)

        def get_vocab(self):
            return {t: i for i, t in enumerate(self.entries)}

        def encode(self, text):
            return [0]

    raw = Tok("a", "\n\n\n", "<0x0A>", "\u2039\uff5cbegin\u2581of\u2581sentence\uff5c>", "\u2581ab", level("\u2014")[0])
    respelled = Tok("a", level("\n\n\n"), level("\n"), level(raw.entries[3]), "\u2581ab", level("\u2014")[0])
    assert level("\n") == "\u010a" and check_vocabularies(raw, respelled) == 6
    for at, other in ((4, "ab"), (5, level("\u3000")[0])):  # "ab" for "▁ab"; byte 0xE3 for 0xE2
        swapped = Tok(*respelled.entries[:at], other, *respelled.entries[at + 1:])
        with pytest.raises(VocabularyMismatch, match=rf"1 id stands for other bytes \(id {at} is "):
            check_vocabularies(raw, swapped)


def test_the_byte_level_alphabet_is_transformers_own():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from decode.vocab import BYTE_OF

    assert BYTE_OF == {letter: b for b, letter in bytes_to_unicode().items()}


def test_mismatch_is_found_before_models_load(tmp_path, monkeypatch):
    import decode.pair as pair_mod

    path = write_tiny_pair(tmp_path, draft_alphabet=ALPHABET[:-1])
    monkeypatch.setattr(pair_mod, "load_model", lambda spec: pytest.fail("models loaded before the vocab check"))
    with pytest.raises(VocabularyMismatch):
        load_pair(path)


def test_every_shipped_pair_config_parses():
    paths = sorted((ROOT / "configs" / "pairs").glob("*.yaml"))
    assert len(paths) >= 4
    for p in paths:
        cfg = PairConfig.from_yaml(p)
        assert cfg.draft.path and cfg.target.path and cfg.hash()


def test_bad_sampling_is_refused(tmp_path):
    with pytest.raises(ValueError, match="top_p"):
        load_pair(write_tiny_pair(tmp_path, top_p=0.0))


def test_a_context_past_the_models_positions_is_refused_in_one_line(tmp_path):
    """The tiny GPT-2 has 128 learned positions: a longer max_context would fail inside torch once a sequence grew past
    them, so loading refuses it, naming the limit; a context that is no number of tokens is refused as it parses."""
    import yaml

    path = write_tiny_pair(tmp_path)
    raw = yaml.safe_load(path.read_text())
    for bad, message in ((100_000, r"^max_context 100000 is longer than the draft's 128 positions "
                                   r"\(max_position_embeddings in its config.json\): set max_context to at most 128"),
                         (0, r"^max_context is the most tokens a sequence holds.*got 0$"),
                         ("long", r"^max_context is the most tokens a sequence holds.*got 'long'$")):
        path.write_text(yaml.safe_dump(raw | {"max_context": bad}))
        with pytest.raises(ValueError, match=message):
            load_pair(path)


def test_a_missing_corrupt_or_misfit_model_is_refused_in_one_line(tmp_path):
    """A model folder that is not there, weights cut short, a config.json asking for layers the weights lack (which
    transformers would fill at random) or shapes they do not have, and a tokenizer file cut short each fail loading
    in one line naming the folder."""
    import yaml

    path = write_tiny_pair(tmp_path)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump(raw | {"draft": {"path": str(tmp_path / "nope")}}))
    with pytest.raises(ValueError, match=r"^\S*nope: no model folder there"):
        load_pair(path)
    path.write_text(yaml.safe_dump(raw))
    weights, config = tmp_path / "target" / "model.safetensors", tmp_path / "draft" / "config.json"
    good, cfg = weights.read_bytes(), json.loads(config.read_text())
    weights.write_bytes(good[:100])
    with pytest.raises(ValueError, match=r"^\S*target cannot be loaded \(Error while deserializing header.*\): copy"):
        load_pair(path)
    weights.write_bytes(good)
    config.write_text(json.dumps(cfg | {"n_layer": cfg["n_layer"] + 2}))
    with pytest.raises(ValueError, match=r"^\S*draft: its weights lack \d+ tensors its config.json asks for"):
        load_pair(path)
    config.write_text(json.dumps(cfg | {"n_embd": 2 * cfg["n_embd"]}))
    with pytest.raises(ValueError, match=r"^\S*draft cannot be loaded \(its weights' shapes do not fit its config.json"):
        load_pair(path)
    config.write_text(json.dumps(cfg | {"n_layer": cfg["n_layer"] - 1}))  # the last layer's tensors would be dropped
    with pytest.raises(ValueError, match=r"^\S*draft: its weights hold \d+ tensors its config.json does not name"):
        load_pair(path)
    config.write_text(json.dumps(cfg))
    tokenizer = tmp_path / "target" / "tokenizer.json"
    text = tokenizer.read_text()
    for broken, error in ((text[:300], "JSONDecodeError"), ("{}", "KeyError")):
        tokenizer.write_text(broken)
        with pytest.raises(ValueError, match=rf"^\S*target: its tokenizer cannot be loaded \({error}: .*\): the folder"):
            load_pair(path)
    tokenizer.write_text(text)
    for broken in (cfg | {"model_type": "no-such-family"}, None):  # a family transformers does not know, no config
        if broken is None:
            config.unlink()
        else:
            config.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=r"^\S*draft: its config.json cannot be read \(.*\): the folder needs") as e:
            load_pair(path)
        assert "\n" not in str(e.value)
    config.write_text(json.dumps(cfg))
    (tmp_path / "draft" / "model.safetensors").unlink()  # an older checkpoint's pickled weights, cut short
    (tmp_path / "draft" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"^\S*draft cannot be loaded \(.*\): copy or export the model again"):
        load_pair(path)


def test_rotary_positions_scaled_past_the_trained_ones_serve_a_longer_context():
    from transformers import LlamaConfig

    from decode.pair import check_positions

    plain = LlamaConfig(max_position_embeddings=128)
    yarn = LlamaConfig(max_position_embeddings=128, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                  "original_max_position_embeddings": 128})
    check_positions(plain, "target", 128)
    check_positions(yarn, "target", 512)
    for config, most in ((plain, 128), (yarn, 512)):
        with pytest.raises(ValueError, match=rf"^max_context {most + 1} is longer than the target's {most} positions"):
            check_positions(config, "target", most + 1)


def test_the_weights_digest_tells_a_retrained_draft_and_not_a_dtype(tiny_pair):
    """A draft trained on (same config, other weights) reads another digest; the same weights in bfloat16 read the same
    one, so a head trained on labels made in one precision serves the other."""
    import copy
    import dataclasses

    from decode.pair import weights_digest

    draft = copy.deepcopy(tiny_pair.draft)
    assert weights_digest(draft) == tiny_pair.identity("draft")["weights"]
    assert weights_digest(copy.deepcopy(draft).to(torch.bfloat16)) == weights_digest(draft)
    with torch.no_grad():
        next(draft.parameters()).mul_(1.5)
    assert weights_digest(draft) != tiny_pair.identity("draft")["weights"]
    # what saved bench splits and recordings are keyed by: the same config with other draft weights is another key
    assert dataclasses.replace(tiny_pair, draft=draft).key() != tiny_pair.key() == tiny_pair.key()
    # weights offloaded by device_map are not in memory: no digest, and a head's recorded one is not compared
    from heads import HeadMismatch, check_draft

    assert weights_digest(torch.nn.Linear(2, 2, device="meta")) == ""
    ident = tiny_pair.identity("draft")
    check_draft({"draft": ident}, ident | {"weights": ""})
    with pytest.raises(HeadMismatch, match="another version of draft .*weights"):
        check_draft({"draft": ident}, ident | {"weights": "0123456789ab"})


@pytest.mark.slow
def test_committed_pycode_pair_metadata():
    pair = load_pair(ROOT / "configs/pairs/pycode.yaml")
    assert pair.vocab == 4096
    d, t = pair.identity("draft"), pair.identity("target")
    assert (d["num_layers"], d["hidden_size"]) == (2, 128)
    assert (t["num_layers"], t["hidden_size"]) == (12, 256)
    infos = {name: json.loads((ROOT / "checkpoints/pycode" / name / "training.json").read_text())
             for name in ("draft", "target")}
    for info in infos.values():  # reproducible: the corpus and the package versions are recorded
        assert info["train_tokens"] > 5_000_000 and info["corpus"]["package_tokens"] > 10_000_000
        assert info["corpus"]["distributions"]["torch"] and info["corpus"]["fingerprint"]
    assert "KL" in infos["draft"]["objective"]  # the draft is distilled from the target
    # the target is the better model on held-out code
    assert json.loads((ROOT / "checkpoints/pycode/target/training.json").read_text())["dev_loss"] < \
        json.loads((ROOT / "checkpoints/pycode/draft/training.json").read_text())["dev_loss"]
