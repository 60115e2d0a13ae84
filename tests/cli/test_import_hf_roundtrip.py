"""A Hugging Face model through the store and back: ``ckptstore import ./HF-DIR run@0`` in a
fresh directory (the import is the first save: it makes the database and the store), the
config and tokenizer files kept with the weights, and ``export --hf`` writing them back so
that ``transformers`` loads the export and computes the same logits as the original.

The models are built here from tiny configs (two layers, no hub downloads) and saved with
``save_pretrained``; the tokenizer is a word-level one built with ``tokenizers``.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore.cli import main

transformers = pytest.importorskip("transformers")

VOCAB = ["[UNK]", "[PAD]", "the", "store", "keeps", "every", "checkpoint", "model", "a", "of"]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def tiny_model(kind: str) -> Any:
    """A two-layer causal LM with random weights (seeded)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=len(VOCAB),
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=len(VOCAB), max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def tiny_tokenizer() -> Any:
    """A word-level fast tokenizer over :data:`VOCAB`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]"
    )


def saved_pretrained(root: Path, kind: str) -> tuple[Path, Any]:
    source = root / f"{kind}-hf"
    model = tiny_model(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(source)
        tiny_tokenizer().save_pretrained(source)
    return source, model


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_import_in_a_fresh_directory_then_export_loads_with_from_pretrained(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTSTORE_DB", raising=False)
    monkeypatch.delenv("CKPTSTORE_STORE", raising=False)
    source, model = saved_pretrained(tmp_path, kind)
    assert not (tmp_path / ".ckptstore").exists()

    code, out, err = cli(capsys, "--json", "import", str(source), f"{kind}@0")
    assert (code, err) == (0, ""), err
    report = json.loads(out)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(report["files"])
    assert "tokenizer_config.json" in report["files"]
    assert (tmp_path / ".ckptstore" / "manifest.db").is_file()
    assert (tmp_path / ".ckptstore" / "store").is_dir()

    code, out, err = cli(capsys, "show", f"{kind}@0")
    assert code == 0
    assert re.search(r"^hf/files +files ", out, re.MULTILINE), out

    export = tmp_path / "export"
    code, out, err = cli(capsys, "export", f"{kind}@0", str(export), "--hf")
    assert (code, err) == (0, ""), err
    for name in report["files"]:
        assert (export / name).read_bytes() == (source / name).read_bytes(), name
    assert not (export / "model.safetensors").exists()  # shards and their index

    loaded = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    ids = tokenizer("the store keeps every checkpoint of a model", return_tensors="pt")
    assert ids["input_ids"].tolist() == [[2, 3, 4, 5, 6, 9, 8, 7]]
    with torch.no_grad():
        expected = model(**ids).logits
        got = loaded(**ids).logits
    assert torch.equal(got, expected)


@pytest.mark.filterwarnings("ignore")
def test_a_dcp_import_has_no_config_and_still_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTSTORE_DB", raising=False)
    monkeypatch.delenv("CKPTSTORE_STORE", raising=False)
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    code, out, err = cli(capsys, "--json", "import", str(tmp_path / "dcp"), "d@3")
    assert (code, err) == (0, ""), err
    assert json.loads(out)["files"] == []
    code, out, err = cli(capsys, "export", "d@3", str(tmp_path / "out"), "--hf")
    assert (code, err) == (0, ""), err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


def test_an_import_that_fails_its_arguments_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTSTORE_DB", raising=False)
    monkeypatch.delenv("CKPTSTORE_STORE", raising=False)
    code, _, err = cli(capsys, "import", str(tmp_path / "nowhere"), "r@0")
    assert code == 2
    assert "does not exist" in err
    assert not (tmp_path / ".ckptstore").exists()
