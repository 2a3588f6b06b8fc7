"""Tokenizer parity with transformers on the SmolLM2 GGUF, chat templates, and HF directories."""

import json
import os

import gguf
import numpy as np
import pytest

from adaflash_jax.checkpoints.gguf import read_gguf, smollm2_gguf_path
from adaflash_jax.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; they're late, we'll see, I'd say.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }  // C\n\tx += 0x1F;",
    "12345 3.14159 1,000,000 -42 2024-06-01 007 1e-5",
    "  leading spaces,   runs   of   spaces\t\ttabs \t mixed   ",
    "\n\nline one\r\nline two\n\n\n   \n",
    "Café naïve résumé Ångström façade über straße",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉 👩‍👩‍👧 flags 🇫🇷 ✔️",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x<file_sep>y",
    "<|im_start|><|im_start|>no space<|im_end|>",
    "< |im_start| > is not special, nor is <|im_start",
    "",
    " ",
    "a" * 300,
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 2 + 2?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 日本."},
    ],
    "multi_turn_with_system": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "  spaces\nand newlines  "},
    ],
}


@pytest.fixture(scope="module")
def smollm2_path():
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(smollm2_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def hf_dir_tokenizer(reference, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    reference.save_pretrained(directory)
    return Tokenizer.from_hf_dir(directory)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == reference.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_whole(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode("x<|endoftext|>y")[1] == 0
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_special_token_facts(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == 2
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert tokenizer.token_to_id("not-a-token-anywhere") is None


def test_from_checkpoint_equals_from_path(tokenizer, smollm2_path):
    from_checkpoint = Tokenizer.from_gguf(read_gguf(smollm2_path))
    for text in TEXTS:
        assert from_checkpoint.encode(text) == tokenizer.encode(text)
    assert from_checkpoint.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, reference, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_default_system_prompt(tokenizer):
    prompt = tokenizer.apply_chat_template(CONVERSATIONS["single_user"])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>assistant\n")
    with_system = tokenizer.apply_chat_template(CONVERSATIONS["with_system"])
    assert with_system.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_hf_dir_matches(hf_dir_tokenizer, tokenizer, reference):
    for text in TEXTS:
        assert hf_dir_tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
        assert hf_dir_tokenizer.encode(text, add_special_tokens=True) == tokenizer.encode(text, add_special_tokens=True)
    for messages in CONVERSATIONS.values():
        assert hf_dir_tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert hf_dir_tokenizer.vocab_size == tokenizer.vocab_size
    assert (hf_dir_tokenizer.bos_token_id, hf_dir_tokenizer.eos_token_id) == (1, 2)
    assert hf_dir_tokenizer.eos_token_ids == [2]


def test_hf_dir_generation_config_eos(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    assert Tokenizer.from_hf_dir(tmp_path).eos_token_ids == [2, 0]


def test_hf_dir_template_inside_tokenizer_config(reference, tokenizer, tmp_path):
    """Older directories keep the template in tokenizer_config.json, possibly as named entries."""
    reference.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": tokenizer.chat_template},
    ]
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == tokenizer.chat_template


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ----- errors --------------------------------------------------------------------------


def test_no_chat_template(tokenizer):
    bare = Tokenizer(tokenizer.backend, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS["single_user"])


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "", "content": "empty role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 42}],
        ["not a dict"],
    ],
)
def test_malformed_messages(tokenizer, messages):
    with pytest.raises(ValueError):
        tokenizer.apply_chat_template(messages)


def test_template_raise_exception_becomes_value_error(tokenizer):
    strict = Tokenizer(
        tokenizer.backend,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
    )
    assert strict.apply_chat_template(CONVERSATIONS["single_user"]) == "ok"
    with pytest.raises(ValueError, match="user first"):
        strict.apply_chat_template(CONVERSATIONS["with_system"])


def test_template_variables_and_trimming(tokenizer, reference):
    """trim_blocks/lstrip_blocks apply to block tags only; tools=None is defined; tojson keeps non-ASCII."""
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "  {{ m['role'] }}={{ m['content'] | tojson }}{{ eos_token }}\n"
        "    {% endfor %}\n"
        "{% if tools is not none %}tools{% endif %}{% if enable_thinking %}think{% endif %}"
    )
    templated = Tokenizer(tokenizer.backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=template)
    messages = [{"role": "user", "content": "<é>"}]
    rendered = templated.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=True)
    assert rendered == '<|im_start|>\n  user="<é>"<|im_end|>\nthink'
    expected = reference.apply_chat_template(messages, chat_template=template, tokenize=False, enable_thinking=True)
    assert rendered == expected


# ----- synthetic GGUF tokenizers -------------------------------------------------------


MERGED_TOKENS = ["Ġt", "he", "12", "123", "Ġ1", "'s", "ĊĊ", "ĠĠ", "Ġthe"]
MERGES = ["Ġ t", "h e", "1 2", "12 3", "Ġ 1", "' s", "Ċ Ċ", "Ġ Ġ", "Ġt he"]


def write_tokenizer_gguf(path, tokenizer_model="gpt2", pre="default", add_bos=True):
    """A tiny byte-level vocabulary: two control tokens, 256 byte symbols, a few merges."""
    byte_symbols = list(_bytes_to_unicode().values())
    tokens = ["<s>", "</s>", *byte_symbols, *MERGED_TOKENS]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"])
def test_pre_tokenizer_families_match_transformers(tmp_path, pre):
    """Digits, contractions and newline runs split differently per family; ids must agree."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    path = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", pre=pre)
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    expected_backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    ours = Tokenizer.from_gguf(path)
    for text in ["the 12345 x 123 he's HE'S", "a\n\n\nb  \n  c", "The Theory 1 12 ！？ x/y/z", "</s>the"]:
        assert ours.encode(text) == expected_backend.encode(text, add_special_tokens=False).ids, text


def test_gguf_add_bos_token(tmp_path):
    tiny = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "bos.gguf"))
    he = tiny.token_to_id("he")
    assert tiny.encode("hex") == [he, tiny.token_to_id("x")]
    assert tiny.encode("hex", add_special_tokens=True) == [0, he, tiny.token_to_id("x")]
    assert tiny.encode("</s>he") == [1, he]
    assert tiny.eos_token_ids == [1]


def test_unsupported_gguf_tokenizer_model(tmp_path):
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "spm.gguf", tokenizer_model="llama"))
