"""A draft/target pair of causal LMs sharing one vocabulary, described by configs/pairs/*.yaml.

Loading checks the vocabularies before any model weights are read, so a mismatched pair
fails in a second with a message naming both sizes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from decode.checks import first_line
from decode.vocab import VocabularyMismatch, check_vocabularies

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sampling:
    """Sampling transform applied identically to both models; temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        number = (int, float)
        ok = (isinstance(self.temperature, number) and not isinstance(self.temperature, bool)
              and math.isfinite(self.temperature) and self.temperature >= 0
              and isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0
              and isinstance(self.top_p, number) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1)
        if not ok:  # (NaN passes every comparison's negation: hence isfinite; an int k: torch.topk takes no float)
            raise ValueError(f"invalid sampling settings {self}: need a finite temperature >= 0, a whole top_k >= 0 and "
                             "0 < top_p <= 1")

    @property
    def name(self) -> str:
        """Short name of the setting, used for label folders and head names: greedy, t1, t0.7-p0.95, t1-k50."""
        if self.temperature == 0:
            return "greedy"  # top-k and top-p do not change an argmax
        name = f"t{self.temperature:g}"
        name += f"-k{self.top_k}" if self.top_k else ""
        return name + (f"-p{self.top_p:g}" if self.top_p < 1 else "")

    @classmethod
    def of(cls, raw: dict | Sampling) -> Sampling:
        """A Sampling from a dict of its fields (as recorded in metadata and head configs)."""
        if not isinstance(raw, (dict, Sampling)):
            raise ValueError(f"a sampling setting is a mapping of temperature, top_k and top_p, got {raw!r}")
        return raw if isinstance(raw, Sampling) else cls(**{k: raw[k] for k in ("temperature", "top_k", "top_p") if k in raw})

    def head_suffix(self, own: Sampling) -> str:
        """'' where this is the pair's own setting `own`, else '-<name>': where a head trained for this setting is
        exported (checkpoints/specdecpp-greedy) and read from ("{suffix}" in the bench configs)."""
        return "" if self.name == own.name else f"-{self.name}"


def read_yaml(path: Path) -> dict:
    """A config file's mapping, or a one-line ValueError saying where the YAML breaks (a hand-edited config's commonest
    fault: a list item under a key written inline, a tab, an unclosed bracket)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path} is not valid YAML{where} ({getattr(e, 'problem', None) or e}); fix that line") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a mapping of keys to values")
    return raw


@dataclass
class ModelSpec:
    """Where one model lives and how to place it. path: a hub id, a local folder, a local .gguf file, or a file in a
    pinned package (pip:PACKAGE==VERSION/PATH.gguf, decode.gguf). embeddings: "own", or "target" for a draft whose
    folder holds every weight but the input embeddings (and the output layer tied to them), which it shares with the
    target at load time, so a distilled draft ships without a copy of the target's vocabulary matrix. head_tokens: a
    draft's file of the token ids its output layer scores, every other token probability 0 (decode.cut)."""

    path: str
    dtype: str = "float32"
    device_map: str | None = None  # e.g. "auto" to shard a large target over GPUs
    revision: str | None = None
    embeddings: str = "own"
    head_tokens: str = ""  # relative to the repository root, like path

    def __post_init__(self):
        if self.embeddings not in ("own", "target"):
            raise ValueError(f"a model's embeddings are 'own' or 'target' (shared with the target), got "
                             f"{self.embeddings!r}")
        if not isinstance(self.head_tokens, str):
            raise ValueError(f"a model's head_tokens is a file of token ids (python -m train.distill --head-tokens N "
                             f"writes one), got {self.head_tokens!r}")
        if not isinstance(getattr(torch, str(self.dtype), None), torch.dtype):
            raise ValueError(f"a model's dtype is a torch dtype name (float32, bfloat16, float16), got {self.dtype!r}")

    def resolved(self) -> str:
        """A local folder relative to the repository root (a GGUF file: its converted folder in the cache, fetched
        and converted on first use), else the hub id unchanged."""
        from decode.gguf import hf_folder, is_gguf

        if is_gguf(self.path):
            return str(hf_folder(self.path, ROOT))
        local = ROOT / Path(self.path).expanduser()
        if self.embeddings == "target" and not (local / "config.json").is_file():
            raise ValueError(f"{self.path} is not a model folder (no config.json there): a draft that shares the "
                             "target's embeddings is a folder exported by python -m train.distill")
        if local.exists():
            return str(local)
        # what is not there locally is a hub id (gpt2, owner/name); a path no hub id can be is a missing folder
        if Path(self.path).is_absolute() or self.path.count("/") > 1 or self.path.startswith((".", "~")):
            raise ValueError(f"{self.path}: no model folder there (a model is a folder relative to the repository "
                             "root, a hub id such as owner/name, or pip:PACKAGE==VERSION/PATH.gguf)")
        return self.path


@dataclass
class PairConfig:
    """One draft/target pair: models, chat template use, sampling, and context limit."""

    name: str
    draft: ModelSpec
    target: ModelSpec
    sampling: Sampling = field(default_factory=Sampling)
    chat_template: bool = False
    max_context: int = 512
    notes: str = ""

    def __post_init__(self):
        if isinstance(self.max_context, bool) or not isinstance(self.max_context, int) or self.max_context < 2:
            raise ValueError(f"max_context is the most tokens a sequence holds, prompt and answer (a whole number >= 2 "
                             f"in the pair's YAML), got {self.max_context!r}")

    @classmethod
    def from_yaml(cls, path: str | Path) -> PairConfig:
        path = Path(path)
        if not path.is_absolute() and not path.exists():
            path = ROOT / path
        if not path.exists():
            raise FileNotFoundError(f"pair config {path} not found; the shipped ones are in configs/pairs/")
        raw = read_yaml(path)
        try:
            return cls(
                name=raw["name"],
                draft=ModelSpec(**raw["draft"]),
                target=ModelSpec(**raw["target"]),
                sampling=Sampling(**raw.get("sampling", {})),
                **{k: raw[k] for k in ("chat_template", "max_context", "notes") if k in raw},
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: malformed pair config ({e}); see configs/pairs/pycode.yaml") from e

    def hash(self) -> str:
        """Short hash of everything that changes the models' distributions."""
        raw = asdict(self)
        for role in ("draft", "target"):  # a spec with no cut hashes as it did before head_tokens existed
            if not raw[role]["head_tokens"]:
                del raw[role]["head_tokens"]
        return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Pair:
    """Loaded models (eval mode, frozen) and tokenizer; vocab is the shared tokenizer size V.

    eos_ids: every token that ends a response (the generation config's list and the tokenizer's EOS). own: the
    setting the pair's YAML names, kept by with_sampling: heads trained for it have no suffix (head_suffix).
    """

    config: PairConfig
    draft: torch.nn.Module
    target: torch.nn.Module
    tokenizer: object
    vocab: int
    eos_ids: tuple[int, ...] = ()
    own: Sampling | None = None

    def __post_init__(self):
        if not self.eos_ids:
            self.eos_ids = eos_ids(self.target, self.tokenizer)
        if self.own is None:
            self.own = self.config.sampling

    def head_suffix(self) -> str:
        """The folder suffix of heads trained for the current setting: '' at the pair's own, else '-<name>'."""
        return self.config.sampling.head_suffix(self.own)

    @property
    def device(self) -> torch.device:
        """Where p and q meet: the device the target's logits come out on (its output layer's, when sharded)."""
        return self.target.get_output_embeddings().weight.device

    def input_device(self, which: str = "target") -> torch.device:
        """Where the draft's or target's input ids go (see input_device)."""
        return input_device(getattr(self, which))

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Prompt text -> token ids as the model expects them (see decode.prompting.encode)."""
        from decode.prompting import encode

        return encode(self.tokenizer, text, self.config.chat_template, max_tokens)

    def with_sampling(self, **changes) -> Pair:
        """The same loaded models under other sampling settings (e.g. temperature=0 for greedy)."""
        sampling = dataclasses.replace(self.config.sampling, **changes)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, sampling=sampling))

    def logits(self, model_logits: torch.Tensor) -> torch.Tensor:
        """(..., V_model) -> (..., V) float32 on self.device: padded embedding rows beyond the tokenizer dropped.

        The one place where p and q meet: the draft's logits move to the target's output device here.
        """
        return model_logits[..., : self.vocab].to(self.device, torch.float32)

    def key(self) -> str:
        """The config's hash and both models' weights digests: what a saved result of this pair (a bench split, a
        recording) is keyed by, so a draft distilled on since does not read it back."""
        return f"{self.config.hash()}-{weights_digest(self.draft)}-{weights_digest(self.target)}"

    def identity(self, which: str = "draft") -> dict:
        """What identifies a model: path, config hash, sizes (recorded in head checkpoints)."""
        return model_identity(getattr(self, which), self.vocab, getattr(self.config, which).path)


def model_identity(model, vocab: int, path: str) -> dict:
    """Path, config hash, weights digest and sizes of a loaded model: what a head checkpoint records of its draft."""
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return {"path": path, "config_hash": digest, "weights": weights_digest(model),
            "hidden_size": model.config.hidden_size, "vocab_size": vocab, "num_layers": model.config.num_hidden_layers}


@torch.no_grad()
def weights_digest(model, per_tensor: int = 16) -> str:
    """12 hex digits of a few values of every parameter (evenly spaced, rounded to bfloat16): a draft distilled on,
    with the same config, reads another digest, so the heads and labels of the old one are refused; the same weights
    loaded in float32 or bfloat16, on any device, read the same (float16 rounds twice and may not). Reads kilobytes,
    not the model. "" where some weights are not in memory (offloaded by device_map): nothing to compare."""
    h = hashlib.sha256()
    params = sorted((name.replace("_orig_mod.", "").removeprefix("module."), w) for name, w in model.named_parameters())
    if any(w.is_meta for _, w in params):
        return ""
    for name, w in params:  # names as the bare model has them: torch.compile and DDP wrap it
        flat = w.reshape(-1)
        n = min(per_tensor, flat.numel())
        idx = (torch.arange(n, device=flat.device) * (flat.numel() - 1)) // max(n - 1, 1)  # in integers: exact
        h.update(f"{name}{tuple(w.shape)}".encode())
        h.update(flat[idx].to(torch.bfloat16).float().cpu().numpy().tobytes())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(getattr(head, "ids", None), torch.Tensor):  # a cut output layer (decode.cut): every id it scores,
        h.update(head.ids.cpu().numpy().tobytes())  # since two cuts can share the few rows sampled above
    return h.hexdigest()[:12]


def input_device(model) -> torch.device:
    """Where a model's input ids go: its input embeddings' device (the first shard under device_map)."""
    return model.get_input_embeddings().weight.device


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a response: the generation config's eos_token_id (an int or a list: Llama-3.1-Instruct
    lists three, Qwen-Instruct two) and the tokenizer's EOS, in that order, without repeats."""
    ids = []
    for raw in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        for i in (raw if isinstance(raw, (list, tuple)) else [raw]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("neither the target's generation config nor its tokenizer names an EOS token: set "
                         "eos_token_id in the target's generation_config.json")
    return tuple(ids)


def load_tokenizers(cfg: PairConfig):
    """(draft's, target's) tokenizers. A draft that shares the target's embeddings reads the target's vocabulary, so
    when its folder holds no tokenizer it takes the target's (python -m train.distill exports none)."""
    t = read_tokenizer(cfg.target.resolved(), cfg.target.revision)
    folder = Path(cfg.draft.resolved())
    if folder.is_dir() and not any((folder / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
        if cfg.draft.embeddings == "target":
            return t, t
        raise ValueError(f"the draft folder {cfg.draft.path} holds no tokenizer (tokenizer_config.json): save the "
                         f"draft's tokenizer there, or set embeddings: target if it shares the target's embeddings")
    return read_tokenizer(str(folder), cfg.draft.revision), t


def read_tokenizer(where: str, revision: str | None):
    """A model's tokenizer, or a one-line ValueError naming the folder whose tokenizer files cannot be read."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, revision=revision)
    except Exception as e:  # noqa: BLE001  (the tokenizers library raises bare Exceptions, KeyErrors, json's errors)
        raise ValueError(f"{where}: its tokenizer cannot be loaded ({type(e).__name__}: {first_line(e)}): the folder "
                         "needs the model's config.json and tokenizer files, readable (a hub id: fetched once, online)") \
            from e


def load_config(spec: ModelSpec):
    from transformers import AutoConfig

    where = spec.resolved()
    try:
        return AutoConfig.from_pretrained(where, revision=spec.revision)
    except (OSError, ValueError, KeyError) as e:  # no config.json, or a model_type this transformers does not know
        raise ValueError(f"{where}: its config.json cannot be read ({first_line(e)}): the folder needs the model's "
                         "config.json, with a model_type this transformers knows (pip install -U transformers for a "
                         "newer family)") from None


def check_positions(config, name: str, max_context: int) -> None:
    """Refuse, in one line, a max_context past a model's positions: a learned position table would fail inside torch
    once a sequence grows past it, and rotary positions past it were never trained."""
    most = getattr(config, "max_position_embeddings", None)
    for rope in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        # rotary positions scaled past the trained ones (YaRN, linear, dynamic) serve factor times as many
        if isinstance(most, int) and isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) != "default":
            most = int(most * float(rope.get("factor") or 1.0))
            break
    if isinstance(most, int) and max_context > most:
        raise ValueError(f"max_context {max_context} is longer than the {name}'s {most} positions "
                         f"(max_position_embeddings in its config.json): set max_context to at most {most} in the pair's "
                         "YAML")


def load_model(spec: ModelSpec, device: torch.device | str | None = None, donor=None):
    """A model frozen in eval mode; on `device` unless its spec shards it with a device_map. donor: the model whose
    input embeddings a spec with embeddings "target" takes."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if spec.embeddings == "target":
        model = with_donor_embeddings(spec, donor)
    else:
        where = spec.resolved()
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                where, dtype=getattr(torch, spec.dtype), device_map=spec.device_map, revision=spec.revision,
                output_loading_info=True)
        except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError) as e:
            why = ("its weights' shapes do not fit its config.json" if "ignore_mismatched_sizes" in str(e)
                   else first_line(e))  # (transformers prints the shapes in a report of its own above)
            raise ValueError(f"{where} cannot be loaded ({why}): copy or export the model again") from e
        # transformers would initialise missing tensors at random and drop unexpected ones, silently
        for kind, keys in (("lack", info["missing_keys"]), ("hold", info["unexpected_keys"])):
            if keys:
                what = "asks for" if kind == "lack" else "does not name"
                raise ValueError(f"{where}: its weights {kind} {len(keys)} tensors its config.json {what} "
                                 f"({', '.join(sorted(keys)[:3])}...): the config and the weights are not of one "
                                 "model")
    if spec.device_map is None and device is not None:  # (a device_map needs accelerate; .to does not)
        model.to(device)
    if spec.head_tokens:
        from decode.cut import cut_head, read_tokens

        cut_head(model, read_tokens(ROOT / spec.head_tokens, model.get_output_embeddings().weight.shape[0]))
    model.eval().requires_grad_(False)
    # Decoding feeds one sequence unpadded, or a padded batch with its mask (decode.cache.rows): a lone EOS token fed
    # to a model whose pad id is the EOS id is not padding, and transformers' "we strongly recommend passing an
    # attention_mask" line (printed the first time a response holds one) would only bury the project's own lines.
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.warn_if_padding_and_no_attention_mask = lambda *args, **kwargs: None
    return model


def with_donor_embeddings(spec: ModelSpec, donor):
    """A model built from its folder's config and weights, its input embeddings (and the output layer tied to them)
    the donor's, cast to the spec's dtype; a one-line ValueError if the folder's weights are not all the rest."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(spec.resolved())  # refuses, in one line, a folder with no config.json
    config = AutoConfig.from_pretrained(folder)
    if donor is None or donor.get_input_embeddings().weight.shape[1] != config.hidden_size:
        raise ValueError(f"{folder} shares the target's embeddings, but the target's width "
                         f"{None if donor is None else donor.get_input_embeddings().weight.shape[1]} is not its "
                         f"{config.hidden_size}: pair it with the target it was distilled from")
    dtype = getattr(torch, spec.dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        state = load_file(folder / "model.safetensors")
    except Exception as e:  # a missing file, or safetensors' own error class for a corrupt one
        raise ValueError(f"{folder / 'model.safetensors'} cannot be read ({' '.join(str(e).split())[:160]}): copy or "
                         "export it again") from e
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a weight of another shape: torch lists every one over many lines
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise ValueError(f"{folder / 'model.safetensors'} does not fit its config.json ({first[:200]})") from e
    embed = [k for k, v in model.state_dict().items() if v.data_ptr() == model.get_input_embeddings().weight.data_ptr()]
    if unexpected or set(missing) - set(embed):
        raise ValueError(f"{folder} does not hold the draft's weights but its embeddings: missing "
                         f"{sorted(set(missing) - set(embed))[:3]}, unexpected {sorted(unexpected)[:3]}")
    weight = donor.get_input_embeddings().weight
    model.get_input_embeddings().weight = torch.nn.Parameter(weight if weight.dtype == dtype else weight.to(dtype),
                                                             requires_grad=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def load_pair(config: PairConfig | str | Path, device: torch.device | str | None = None) -> Pair:
    """Check the vocabularies, then load both models frozen in eval mode; refuse a model the engine cannot serve.

    device: where models without a device_map go (default: the CPU, or "cuda" when one is present).
    """
    from transformers.utils import logging as hf_logging

    from decode.cache.kv import check_servable

    hf_logging.disable_progress_bar()
    cfg = config if isinstance(config, PairConfig) else PairConfig.from_yaml(config)
    draft_tok, target_tok = load_tokenizers(cfg)
    vocab = check_vocabularies(draft_tok, target_tok)
    for name in ("draft", "target"):
        model_config = load_config(getattr(cfg, name))
        check_servable(model_config, name)
        check_positions(model_config, name, cfg.max_context)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.target.embeddings != "own":
        raise ValueError("the target's embeddings are its own: embeddings: target is for a draft that shares them")
    if cfg.target.head_tokens:
        raise ValueError("the target scores every token: head_tokens is for a draft (a cut target would change the "
                         "law its speculative decoding keeps)")
    target = load_model(cfg.target, device)
    draft = load_model(cfg.draft, device, donor=target)
    for name, m in (("draft", draft), ("target", target)):
        rows = m.get_output_embeddings().weight.shape[0]
        if rows < vocab:
            raise VocabularyMismatch(f"{name} has {rows} output rows for a {vocab}-token tokenizer")
    if target_tok.pad_token_id is None:
        target_tok.pad_token = target_tok.eos_token
    return Pair(cfg, draft, target, target_tok, vocab)
