"""The README's Python examples run as they stand (the guide's run as
doctests: ``pytest docs/guide``).  The Hugging Face snippet loads a tiny
model saved to a temporary directory, so its ``from_pretrained(path)`` runs
without a download."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    if not README.exists():
        return []
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), re.M | re.S)


BLOCKS = python_blocks()


def test_readme_has_examples():
    if not README.exists():
        pytest.skip("README.md is not in this checkout")
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path):
    ns = {}
    if "transformers" in code:
        pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128)
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
        ns["path"] = str(tmp_path)
    exec(compile(code, str(README), "exec"), ns)
    if "transformers" in code:
        assert ns["model"].config._attn_implementation == "attncore"
